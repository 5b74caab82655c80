"""`neuron-serving monitoring prometheusrule|rules|dashboards|config`: the monitoring
files for a Prometheus and Grafana of your own (neuron_serving/monitoring/README.md).

``prometheusrule`` prints the alert rules as a Kubernetes PrometheusRule; ``rules``
prints the rule file's path (for ``rule_files:``); ``dashboards --out DIR`` writes the
Grafana dashboards; ``config`` prints a prometheus.yml scraping the file SD targets of
a local cluster's run directory (what `up` runs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from neuron_serving.exitcodes import ExitCode


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "monitoring", help="alert rules and Prometheus config for your own Prometheus"
    )
    verbs = p.add_subparsers(dest="verb", required=True)
    rule = verbs.add_parser("prometheusrule", help="the alert rules as a Kubernetes PrometheusRule")
    rule.add_argument("--name", default="neuron-serving")
    rule.add_argument("--namespace", default=None)
    rule.add_argument("--label", action="append", default=[], metavar="K=V",
                      help="a label the operator's ruleSelector matches (repeatable)")  # fmt: skip
    verbs.add_parser("rules", help="the path of the alert rule file")
    dash = verbs.add_parser("dashboards", help="write the Grafana dashboards (JSON)")
    dash.add_argument("--out", required=True, metavar="DIR")
    cfg = verbs.add_parser("config", help="a prometheus.yml for a local cluster's run directory")
    cfg.add_argument("--run-dir", required=True, metavar="DIR")
    cfg.add_argument("--listen", default="127.0.0.1:9090", metavar="HOST:PORT")
    cfg.add_argument("--scrape-interval", type=float, default=5.0, metavar="S")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from neuron_serving.monitoring import prometheus, rules

    if args.verb == "prometheusrule":
        labels = {}
        for kv in args.label:
            key, sep, value = kv.partition("=")
            if not sep or not key:
                print(f"neuron-serving monitoring: --label {kv!r}: expected K=V", file=sys.stderr)
                return ExitCode.USAGE
            labels[key] = value
        doc = rules.prometheus_rule(args.name, args.namespace, labels)
        sys.stdout.write(yaml.safe_dump(doc, sort_keys=False, width=1000))
        return ExitCode.OK
    if args.verb == "rules":
        print(prometheus.ALERT_RULES)
        return ExitCode.OK
    if args.verb == "dashboards":
        from neuron_serving.monitoring import dashboards

        for path in dashboards.write_all(Path(args.out)):
            print(path)
        return ExitCode.OK
    run_dir = Path(args.run_dir)
    config = prometheus.config(run_dir / "prometheus" / "targets", args.scrape_interval,
                               run_dir / "admin-token", args.listen)  # fmt: skip
    sys.stdout.write(yaml.safe_dump(config, sort_keys=False))
    return ExitCode.OK

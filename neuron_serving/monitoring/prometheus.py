"""A Prometheus server's configuration for a fleet: four jobs fed by file-based service
discovery (``targets.py``), the alert rules of ``rules/``, and the command line that
runs it. Rendered here, run by the local supervisor (``local/prometheus.py``), and
documented for ECS (``ecs/README.md``).

The binary is Debian's ``prometheus`` package (``make install`` installs it where
apt-get exists): ``find_binary`` looks on PATH, then /usr/bin.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from neuron_serving.monitoring.targets import JOBS, file_sd_path

RULES_DIR = Path(__file__).parent / "rules"
ALERT_RULES = RULES_DIR / "alerts.yml"
# Every job name starts so; the rules and dashboards select jobs by it.
JOB_PREFIX = "neuron-serving-"
# Jobs whose endpoints want the admin token (the proxies' admin ports, the supervisor's).
AUTHORIZED_JOBS = ("proxies", "supervisor")
# Jobs whose series carry their own unit/rank/... labels (the nodes').
HONOR_LABELS_JOBS = ("leaders", "followers")


def find_binary(name: str = "prometheus") -> str | None:
    """``prometheus`` or ``promtool``: on PATH, or where Debian's package puts them."""
    found = shutil.which(name)
    if found:
        return found
    debian = Path("/usr/bin") / name
    return str(debian) if debian.exists() else None


def duration(seconds: float) -> str:
    """A Prometheus duration: whole milliseconds ("1.6s" is not one; "1600ms" is)."""
    return f"{round(seconds * 1000)}ms"


def config(
    sd_dir: Path, interval_s: float, token_file: Path | None, self_addr: str,
    rule_files: tuple[Path, ...] = (ALERT_RULES,),
) -> dict[str, Any]:  # fmt: skip
    """prometheus.yml as a dict: every job scraped and every rule evaluated each
    ``interval_s``; ``token_file`` holds the admin token for the authorized jobs."""
    interval = duration(interval_s)
    scrape: list[dict[str, Any]] = []
    for job in JOBS:
        cfg: dict[str, Any] = {
            "job_name": JOB_PREFIX + job,
            "file_sd_configs": [
                {"files": [str(file_sd_path(sd_dir, job))], "refresh_interval": interval}
            ],  # fmt: skip
        }
        if job in HONOR_LABELS_JOBS:
            cfg["honor_labels"] = True
        if job in AUTHORIZED_JOBS and token_file is not None:
            cfg["authorization"] = {"type": "Bearer", "credentials_file": str(token_file)}
        scrape.append(cfg)
    scrape.append({"job_name": "prometheus", "static_configs": [{"targets": [self_addr]}]})
    return {
        "global": {
            "scrape_interval": interval,
            # Under the interval: a hung endpoint costs one missed scrape, not a pile-up.
            "scrape_timeout": duration(max(1.0, interval_s * 0.8)),
            "evaluation_interval": interval,
        },
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": scrape,
    }


def argv(binary: str, config_file: Path, data_dir: Path, listen: str,
         retention: str = "7d") -> list[str]:  # fmt: skip
    return [
        binary,
        f"--config.file={config_file}",
        f"--storage.tsdb.path={data_dir}",
        f"--storage.tsdb.retention.time={retention}",
        f"--web.listen-address={listen}",
        "--log.level=warn",
    ]

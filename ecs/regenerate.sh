#!/bin/sh
# Re-render ecs/task-definitions/<instance type>/{leader,follower}.json from ecs/unit-specs/.
# tests/neuron_serving/ecs/test_templates.py fails when they drift from the renderer.
set -eu
cd "$(dirname "$0")/.."
for spec in ecs/unit-specs/*.yaml; do
    itype=$(basename "$spec" .yaml)
    name=$(sed -n 's/^name: *//p' "$spec")
    out=$(mktemp -d)
    python -m neuron_serving.cli ecs render --unit-spec "$spec" --out "$out" >/dev/null
    mkdir -p "ecs/task-definitions/$itype"
    for role in leader follower; do
        cp "$out/task-definitions/$name-$role.json" "ecs/task-definitions/$itype/$role.json"
    done
    rm -rf "$out"
done

#!/usr/bin/env python3
"""Writes the part of a Kubernetes JSON Schema bundle that the manifests under envoy/k8s/ need.

Usage: subset.py <_definitions.json> > v1.37.0-strict-subset.json

The input is `kubernetes_validate/kubernetes-json-schema/v1.37.0-local-strict/_definitions.json`
from the PyPI wheel kubernetes-validate 1.37.0 (JSON Schema 2020-12 generated from the upstream
Kubernetes OpenAPI spec; "strict": every object has additionalProperties false). The output keeps
the definitions reachable through $ref from the roots below, unchanged, so the file stays small.
"""
import json
import sys

ROOTS = [
    "io.k8s.api.apps.v1.Deployment",
    "io.k8s.api.core.v1.Service",
    "io.k8s.api.core.v1.ConfigMap",
    # metadata of the custom resources (their CRDs only say `type: object`).
    "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
]


def refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def main():
    bundle = json.load(open(sys.argv[1]))
    defs = bundle["$defs"]
    keep, stack = set(), list(ROOTS)
    while stack:
        name = stack.pop()
        if name not in keep:
            keep.add(name)
            stack.extend(ref.rsplit("/", 1)[-1] for ref in refs(defs[name]))
    out = {"$schema": bundle["$schema"], "$defs": {name: defs[name] for name in sorted(keep)}}
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

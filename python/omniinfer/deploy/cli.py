"""``omniinfer deploy FILE``: start the deployment on this machine, or render it elsewhere."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

RENDERS = ("commands", "lws", "rbg")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "deploy", help="start a PD deployment described by one YAML file",
        description="Start every server of the file and the router on this machine, print "
        "their URLs and stop them all on Ctrl-C or when one fails; or, with --render, print "
        "the command lines or Kubernetes manifests for other machines.")
    p.add_argument("file", help="the deployment file (YAML)")
    p.add_argument("--render", choices=RENDERS,
                   help="print instead of starting: shell lines, LeaderWorkerSet or "
                   "RoleBasedGroup manifests")
    p.add_argument("--check", action="store_true", help="only check the file")
    p.add_argument("--log-dir", help="where the processes' logs go (default: a new temp dir)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from omniinfer.deploy import local, render
    from omniinfer.deploy.spec import DeployError, load

    try:
        dep = load(args.file)
        if args.check:
            print(f"{args.file}: ok ({dep.prefill.count} prefill, {dep.decode.count} decode, "
                  f"router {dep.router.prefill_policy}/{dep.router.decode_policy})")
            return 0
        if args.render == "commands":
            sys.stdout.write(render.commands(dep))
            return 0
        if args.render in ("lws", "rbg"):
            docs = render.lws(dep) if args.render == "lws" else render.rbg(dep)
            sys.stdout.write(render.manifests_yaml(docs))
            return 0
        log_dir = Path(args.log_dir) if args.log_dir else Path(
            tempfile.mkdtemp(prefix="omniinfer-deploy-"))
        print(f"logs: {log_dir}", flush=True)
        return local.run(dep, log_dir)
    except DeployError as exc:
        print(f"omniinfer deploy: error: {exc}", file=sys.stderr)
        return 2

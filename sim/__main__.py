"""`python -m sim ...`: the simulated installation, for a person to use on its own.

- `python -m sim demo [--keep]` runs the demo (`make demo`): a stand-in cluster with two GPU
  nodes, the controlplane's workers on them in direct and tunnel mode, GPU tasks and an
  endpoint; it ends with the dashboard's address, and `--keep` keeps it up until Ctrl-C.
- `python -m sim demo-ha` (`make demo-ha`): three controlplane replicas over PostgreSQL behind
  one Service, and the one holding a running task's worker killed; the task goes on.
- `python -m sim chaos [--seed N] [--minutes M] [--json FILE] [--kinds K,...]` (`make chaos`):
  the seeded fault campaign over the whole installation (`sim.chaos.campaign`); it prints faults
  by kind with their recovery times, tasks by end state and every invariant violation, and
  exits 1 if there was one.
- `python -m sim cluster [--nodes N] [--pods-per-node M] [--dir DIR]` serves the Kubernetes
  API stand-in with N eight-card GPU nodes over TLS on loopback, writes a kubeconfig and
  serves until Ctrl-C, for a `kubectl` session or a controlplane of your own.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path


def _cluster(args: argparse.Namespace) -> int:
    from sim.kubeapi.http import start_kube_standin
    from sim.kubeapi.store import synthetic_cluster

    with tempfile.TemporaryDirectory(prefix="levers9-sim-") as scratch:
        directory = args.dir or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        running = start_kube_standin(directory)
        try:
            synthetic_cluster(running.kube, args.nodes, args.pods_per_node)
            kubeconfig = running.kube.write_kubeconfig(directory / "kubeconfig")
            print(f"Kubernetes API stand-in at {running.kube.url} with {args.nodes} GPU nodes")
            print(f"  export KUBECONFIG={kubeconfig}")
            print("  kubectl get nodes   # Ctrl-C stops it", flush=True)
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                pass
        finally:
            running.stop()
    return 0


def _missing_extras() -> list[str]:
    """The simulator's own dependencies (the `sim` extra) that this Python lacks."""
    import importlib.util

    from nvml.standin import StandinError, nvml_include_dir

    missing = [name for name in ("trustme",) if importlib.util.find_spec(name) is None]
    try:
        nvml_include_dir()
    except StandinError:
        missing.append("nvidia-nvml-dev")
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo", help="run the demo end to end (what `make demo` runs)"
    )
    demo_parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the installation and its dashboard up after the demo, until Ctrl-C "
        "(`make demo KEEP=1`)",
    )
    commands.add_parser(
        "demo-ha",
        help="three controlplane replicas over PostgreSQL, one killed mid-task "
        "(what `make demo-ha` runs)",
    )
    commands.add_parser(
        "chaos",
        add_help=False,
        help="the seeded fault campaign (what `make chaos` runs; `chaos --help` for its options)",
    )
    cluster = commands.add_parser("cluster", help="serve the Kubernetes API stand-in")
    cluster.add_argument("--nodes", type=int, default=2, help="GPU nodes (8 cards each)")
    cluster.add_argument("--pods-per-node", type=int, default=0, help="neighbour pods per node")
    cluster.add_argument("--dir", type=Path, help="where to keep the kubeconfig and certificates")
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "chaos":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    missing = _missing_extras()
    if missing:
        print(
            f"python -m sim: {', '.join(missing)} missing; install the simulator's "
            "dependencies with: pip install 'levers9[sim]'",
            file=sys.stderr,
        )
        return 2
    if args.command == "demo":
        from sim.demo import main as demo

        return demo(keep=args.keep)
    if args.command == "chaos":
        from sim.chaos.campaign import main as chaos

        return chaos(rest)
    if args.command == "demo-ha":
        from sim.demo_ha import main as demo_ha

        return demo_ha()
    if args.nodes < 0 or args.pods_per_node < 0:
        parser.error("--nodes and --pods-per-node must be 0 or more")
    return _cluster(args)


if __name__ == "__main__":
    sys.exit(main())

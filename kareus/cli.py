"""The ``kareus`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from rich.table import Table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kareus", description=__doc__)
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="train a small tensor-parallel Llama on 2 gloo CPU processes"
    )
    demo.add_argument("--world-size", type=_positive, default=2)
    demo.add_argument("--steps", type=_positive, default=12)
    demo.add_argument("--layers", type=_positive, default=2)
    demo.add_argument("--sequence-parallel", action="store_true")
    demo.add_argument("--lowering", choices=("inductor", "eager"), default="inductor")
    demo.add_argument("--nanobatches", type=int, choices=(1, 2, 4), default=2)
    demo.add_argument(
        "--device",
        default="auto",
        help='"auto", "nvml", "nvml-dry-run", "sim:<preset>" or a GPU .json',
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
        format="%(levelname)s %(name)s: %(message)s",
    )
    return {"demo": _demo}[args.command](args)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _demo(args: argparse.Namespace) -> int:
    from kareus.demo import DemoConfig, run
    from kareus.models.llama import LlamaConfig
    from kareus.reports import make_console, print_report

    console = make_console()
    cfg = DemoConfig(
        world_size=args.world_size,
        steps=args.steps,
        model=LlamaConfig(n_layers=args.layers),
        sequence_parallel=args.sequence_parallel,
        options={"lowering": args.lowering, "device": args.device, "nanobatches": args.nanobatches},
    )
    layout = "TP + sequence parallel" if cfg.sequence_parallel else "TP"
    console.print(
        f"[bold]kareus demo[/]: {cfg.model.n_layers}-layer Llama (dim {cfg.model.dim}), "
        f"{layout} over {cfg.world_size} gloo processes, {cfg.options['lowering']} lowering, "
        f"device {cfg.options['device']}, {cfg.options['nanobatches']} nanobatches, "
        f"{cfg.steps} AdamW steps"
    )
    start = time.perf_counter()
    results = run(cfg)
    elapsed = time.perf_counter() - start
    rank0 = results[0]
    for report in rank0.reports:
        print_report(report, console)
    table = Table(title="loss curve (rank 0)", title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("loss", justify="right")
    table.add_column("")
    top = max(rank0.losses)
    for step, loss in enumerate(rank0.losses):
        table.add_row(str(step), f"{loss:.4f}", "█" * max(1, round(50 * loss / top)))
    console.print(table)
    console.print(
        "collectives kept split into nanobatches (rank 0): "
        + "; ".join(f"{r.label} {r.coverage.split}/{r.coverage.total}" for r in rank0.reports)
    )
    console.print(
        f"clock switches recorded on rank 0: {len(rank0.clock_switches)} "
        f"(one per graph execution); finished in {elapsed:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``kareus`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names; its exit status (130: interrupted, one line said)."""
    return _run(build_parser().parse_args(argv))


def console(argv: list[str] | None = None) -> None:
    """The ``kareus`` command: ``main``, then the process ends with its status. An
    interrupted ``plan`` or ``bench`` ends it at once (``interrupts.end_process``: the
    interpreter's exit can abort under what they left running); ``demo`` exits as usual,
    so that its clocks are reset and its processes joined."""
    args = build_parser().parse_args(argv)
    status = _run(args)
    if status == 130 and args.command in ("plan", "bench"):
        from kareus import interrupts

        interrupts.end_process(status)
    raise SystemExit(status)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
        format="%(levelname)s %(name)s: %(message)s",
    )
    command = {"demo": _demo, "plan": _plan, "bench": _bench, "show": _show}[args.command]
    try:
        return command(args)
    except KeyboardInterrupt:  # one line, not a traceback: every output is written whole
        print(f"kareus {args.command}: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    """``kareus`` and its subcommands' arguments, every option's help with its default."""
    from kareus.devices.resolve import DEFAULT_SIMULATED
    from kareus.version import __version__

    parser = argparse.ArgumentParser(
        prog="kareus", formatter_class=HelpFormatter,
        description="kareus: a torch.compile backend for energy-efficient distributed "
        "training; its demo, offline planner, benchmark suite and viewer")
    parser.add_argument("--version", action="version", version=f"kareus {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="train a small tensor-parallel Llama on 2 gloo CPU processes",
        formatter_class=HelpFormatter,
    )
    demo.add_argument("--world-size", type=_positive, default=2,
                      help="gloo processes, one a tensor-parallel rank")
    demo.add_argument("--steps", type=_positive, default=12, help="AdamW steps")
    demo.add_argument("--layers", type=_positive, default=2, help="transformer blocks")
    demo.add_argument("--dim", type=_positive, default=512, help="model width")
    add_shape_arguments(demo, seq_len=128)
    demo.add_argument("--lowering", choices=("inductor", "eager"), default="inductor",
                      help="how each compiled graph runs: Inductor's code or eager ops")
    demo.add_argument("--nanobatches", choices=("1", "2", "4", "auto"), default="auto",
                      help="the nanobatch count, or auto: the plan picks one per graph")
    demo.add_argument(
        "--device", default="auto",
        help='the GPU to profile and plan on: "auto" (the local GPU through NVML, else '
        f'{DEFAULT_SIMULATED}), "nvml", "nvml-dry-run" (measured, clock switches only '
        f'recorded), a simulated GPU ({_presets()}) or a GPU .json',
    )
    _add_budget(demo, default="1.1")
    demo.add_argument("--out", default="kareus-demo-plan.png",
                      help="the frontier plot; the plan goes beside it as .json (kareus show "
                      "reads it)")
    demo.add_argument("--no-paper-plan", action="store_true",
                      help="skip the offline plan of a paper-sized workload at the end")
    plan = sub.add_parser(
        "plan", help="plan a model's training iteration offline on a simulated GPU, beside "
        "the baseline and Perseus", formatter_class=HelpFormatter,
    )
    add_workload_arguments(plan)
    add_plan_arguments(plan)
    _add_budget(plan, default="the fastest plan")
    bench = sub.add_parser(
        "bench", help="the benchmark suite: kareus, Perseus and the baseline on the method's "
        "workloads, planned offline on simulated GPUs", formatter_class=HelpFormatter,
    )
    bench.add_argument("--quick", action="store_true", help="one small workload (seconds)")
    bench.add_argument("--out", default="benchmarks/results",
                       help="the directory of suite.json and the PNGs")
    _add_cache_dir(bench)
    show = sub.add_parser(
        "show", help="a plan, a plan result or a profile store: a table and a frontier plot",
        formatter_class=HelpFormatter,
    )
    show.add_argument("target", help="a plan JSON file (kareus plan --plan-json, kareus demo), "
                      "a plan result (kareus plan --json), a profile store file or its "
                      "directory")
    show.add_argument("--out", default=None,
                      help="the PNG, or a directory to write it in (default: beside the target)")
    return parser


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default at the end of its help, except where there is none to show
    (None, a flag's False) or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help
                                                                             or ""):
            return action.help
        return super()._get_help_string(action)


def parser_for_plan() -> argparse.ArgumentParser:
    """``kareus plan``'s own arguments (the demo plans with them too)."""
    parser = argparse.ArgumentParser(prog="kareus plan", formatter_class=HelpFormatter)
    add_workload_arguments(parser)
    add_plan_arguments(parser)
    return parser


def _presets() -> str:
    from kareus.devices.sim.presets import preset_names

    return ", ".join(preset_names())


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="sim:a100-sxm4-40gb",
                        help=f"a simulated GPU ({_presets()}) or a GPU .json")
    parser.add_argument("--json", default="kareus-plan.json",
                        help="the plan result: every method's frontier (time and energy per "
                        "iteration of all tp x pp GPUs), the chosen point and the metrics; "
                        "kareus show reads it. Not what a compile loads: see --plan-json")
    parser.add_argument("--png", default=None,
                        help="the frontier plot (default: beside --json, .png)")
    parser.add_argument("--plan-json", default=None,
                        help="the plan a compile loads as its plan option (costs per GPU, or "
                        "with pipeline parallelism per iteration of one replica; kareus show "
                        "reads it too; default: beside --json, .plan.json)")
    _add_cache_dir(parser)
    parser.add_argument("--search", choices=("grid", "bayesian"), default="grid",
                        help="how each distinct partition is searched: grid, every variant "
                        "(instant on a simulated GPU), or bayesian, within --search-budget")
    parser.add_argument("--search-budget", type=_positive, default=32,
                        help="the most variants measured per distinct partition with --search "
                        "bayesian")
    parser.add_argument(
        "--max-solve-s", type=_positive_seconds, default=20.0,
        help="seconds per solve of a pipeline plan; past them the best plan found is kept "
        "with its proven gap (in the JSON and the table; default 20, as kareus bench; 0: "
        "solve exactly, which can take an hour on an uneven 2-stage split). A pipeline of "
        "over 256 instructions is planned by shared options, its gap always stated")


def _add_cache_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", default=None,
                        help="the profile store's directory (default: $KAREUS_CACHE_DIR, else "
                        "$XDG_CACHE_HOME/kareus, else ~/.cache/kareus)")


def add_shape_arguments(parser: argparse.ArgumentParser, seq_len: int) -> None:
    """A microbatch's shape and its sequence parallelism, named alike by ``demo`` and
    ``plan``; their earlier spellings (``--batch``, ``--seq``, ``--sp``) still parse, left
    out of the help."""
    parser.add_argument("--microbatch-size", type=_positive, default=8,
                        help="sequences per microbatch (the demo's step is one microbatch)")
    parser.add_argument("--seq-len", type=_positive, default=seq_len,
                        help="tokens per sequence")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="shard the activations between tensor-parallel regions on the "
                        "sequence (Megatron's sequence parallelism)")
    for old, new in (("--batch", "microbatch_size"), ("--seq", "seq_len")):
        parser.add_argument(old, type=_positive, dest=new, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)
    parser.add_argument("--sp", action="store_true", dest="sequence_parallel",
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """A model and its layout (``offline.Workload``), shared with the benchmark suite."""
    parser.add_argument("model", help="a preset (llama3.2-1b, llama3.2-3b, llama3.1-8b, "
                        "llama3.1-70b, qwen3-1.7b, qwen3-8b) or a Hugging Face config.json")
    parser.add_argument("--tp", type=_positive, default=8, help="tensor-parallel degree")
    parser.add_argument("--pp", type=_positive, default=1,
                        help="pipeline-parallel degree (stages)")
    parser.add_argument("--microbatches", type=_positive, default=8,
                        help="microbatches per iteration")
    add_shape_arguments(parser, seq_len=4096)
    parser.add_argument("--recompute", choices=("none", "full"), default="none",
                        help="activation recomputation: none, or full (every layer's forward "
                        "recomputed in its backward)")
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                        help="the pipeline schedule")
    parser.add_argument(
        "--layout", choices=("megatron", "torchtitan"), default="megatron",
        help="how the model is written: megatron (default; as Megatron-LM runs it: fused QKV "
        "and gate-up projections, 2 all-reduces per block forward and 2 backward, logits "
        "sharded on the vocabulary and a vocab-parallel loss) or torchtitan (as torchtitan "
        "and Hugging Face write it: separate q, k, v, gate and up projections, 5 all-reduces "
        "per block backward, logits all-gathered and a replicated loss)")
    parser.add_argument(
        "--first-stage-layers", default=None, metavar="N|even",
        help="the first pipeline stage's layers (Megatron's "
        "num_layers_in_first_pipeline_stage), the later stages splitting the rest evenly; "
        "'even': an even split; default: the method's artifact's split where it ran the "
        "preset at this pp (llama3.2-3b and qwen3-1.7b at pp 2: 15 of 28), else even")
    parser.add_argument(
        "--regions", choices=("block", "stage"), default="block",
        help="how the model is compiled: block (default; a region per transformer block, as "
        "torchtitan compiles: nanobatches joined at every block's end) or stage (each "
        "pipeline stage one region: nanobatches flow from block to block, one's last "
        "collective of a block hidden behind the other's next block)")


def _add_budget(parser: argparse.ArgumentParser, default: str) -> None:
    what = "step" if default == "1.1" else "iteration"
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--time-budget", default=None, help=f"a fraction of the baseline {what} "
                        f'time (1.1) or "12 ms"; with no budget: {default}')
    budget.add_argument("--energy-budget", default=None,
                        help=f'a fraction of the baseline {what} energy (0.95) or "2 J"')
    budget.add_argument("--energy-time-tradeoff", type=float, default=None,
                        help="Zeus's eta in [0, 1]: 0 weighs time only, 1 energy only")
    budget.add_argument("--fastest", action="store_true",
                        help="no budget: the least energy no slower than the fastest plan")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _amount(text: str | None) -> float | str | None:
    """A budget from the command line: a number is a fraction of the baseline's."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return text


def _budget(args: argparse.Namespace, default: float | None = 1.1) -> dict[str, object]:
    if args.fastest:  # no budget, said as such: left unset, a compile's defaults to 1.0
        return {"time_budget": None}
    if args.energy_budget is not None:
        return {"energy_budget": _amount(args.energy_budget)}
    if args.energy_time_tradeoff is not None:
        return {"energy_time_tradeoff": args.energy_time_tradeoff}
    if args.time_budget is not None:
        return {"time_budget": _amount(args.time_budget)}
    return {} if default is None else {"time_budget": default}


def _plan(args: argparse.Namespace) -> int:
    from kareus import interrupts
    from kareus.errors import KareusError
    from kareus.offline.cli import plan_command
    from kareus.profiler.progress import make_console

    console = make_console()
    try:
        with interrupts.at_safe_points():
            plan_command(args, _budget(args, default=None), console)
    except KareusError as exc:
        return _refused(console, "plan", exc)
    return 0


def _refused(console: Console, command: str, exc: Exception) -> int:
    """Print why ``command`` cannot run as one line (never wrapped, brackets in paths and
    ranges not read as markup) and return the usage-error status."""
    message = " ".join(str(exc).split())
    console.print(Text.assemble((f"kareus {command}:", "red"), f" {message}"), soft_wrap=True,
                  highlight=False)
    return 2


def _bench(args: argparse.Namespace) -> int:
    from kareus import interrupts
    from kareus.errors import KareusError
    from kareus.offline.suite import MATRIX, QUICK, run_suite
    from kareus.profiler.progress import make_console

    console = make_console()
    try:
        with interrupts.at_safe_points():
            run_suite(QUICK if args.quick else MATRIX, Path(args.out), console,
                      cache_dir=args.cache_dir)
    except KareusError as exc:
        return _refused(console, "bench", exc)
    return 0


def _show(args: argparse.Namespace) -> int:
    from kareus.errors import KareusError
    from kareus.profiler.progress import make_console
    from kareus.show import show

    console = make_console()
    try:
        show(args.target, args.out, console)
    except KareusError as exc:
        return _refused(console, "show", exc)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kareus.demo import DemoConfig, check, run
    from kareus.errors import KareusError
    from kareus.models.llama import LlamaConfig
    from kareus.offline.report import writable
    from kareus.profiler.progress import make_console
    from kareus.reports import print_report
    from kareus.show import show

    console = make_console()
    nanobatches = args.nanobatches if args.nanobatches == "auto" else int(args.nanobatches)
    options = {"lowering": args.lowering, "device": args.device, "nanobatches": nanobatches,
               **_budget(args)}
    try:  # what a worker would fail on fails here, once, before any is spawned
        cfg = DemoConfig(
            world_size=args.world_size,
            steps=args.steps,
            batch=args.microbatch_size,
            seq_len=args.seq_len,
            model=LlamaConfig(n_layers=args.layers, dim=args.dim, ffn_dim=3 * args.dim,
                              n_heads=max(1, args.dim // 64), max_seq_len=args.seq_len),
            sequence_parallel=args.sequence_parallel,
            options=options,
        )
        check(cfg)
        for path in _demo_outputs(args):
            writable(path)
    except KareusError as exc:
        return _refused(console, "demo", exc)
    layout = "TP + sequence parallel" if cfg.sequence_parallel else "TP"
    budget = ", ".join(f"{k} {v}" for k, v in _budget(args).items()
                       if v is not None) or "the fastest plan"
    console.print(
        f"[bold]kareus demo[/]: {cfg.model.n_layers}-layer Llama (dim {cfg.model.dim}), "
        f"{layout} over {cfg.world_size} gloo processes, {cfg.options['lowering']} lowering, "
        f"device {cfg.options['device']}, nanobatches {nanobatches}, budget: {budget}, "
        f"{cfg.steps} AdamW steps"
    )
    start = time.perf_counter()
    try:
        results = run(cfg)
    except KareusError as exc:  # a worker's, e.g. a budget no plan meets
        return _refused(console, "demo", exc)
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
    switches: dict[tuple[str, int], int] = {}
    for graph, mhz in rank0.clock_switches:
        switches[graph, mhz] = switches.get((graph, mhz), 0) + 1
    console.print(
        f"clock switches recorded on rank 0: {len(rank0.clock_switches)} (one per graph "
        "execution; 0 MHz: the default clock): "
        + ", ".join(f"{g} at {mhz} MHz x{n}" for (g, mhz), n in switches.items())
    )
    if rank0.plan is not None:
        if any(r.plan != rank0.plan for r in results):
            console.print("[red]the ranks ran different plans[/]")
            return 1
        plan_path = rank0.plan.save(Path(args.out).with_suffix(".json"))
        show(plan_path, args.out, console)
    else:
        console.print("no plan was made (nothing to choose: see the graph reports)")
    console.print(f"finished in {elapsed:.1f} s")
    if args.no_paper_plan:
        return 0
    from kareus.offline.cli import PAPER_WORKLOAD, plan_command

    console.print(
        "[bold]kareus plan[/]: the demo's model is too small for overlap to pay; a paper-sized "
        f"workload planned offline ({PAPER_WORKLOAD}), beside Perseus and the baseline:"
    )
    paper = parser_for_plan().parse_args([*PAPER_WORKLOAD.split(), "--json", str(_paper(args))])
    try:
        plan_command(paper, _budget(args), console)
    except KareusError as exc:
        return _refused(console, "demo", exc)
    return 0


def _paper(args: argparse.Namespace) -> Path:
    """The result JSON of the demo's closing offline plan."""
    return Path(args.out).with_name("kareus-demo-paper.json")


def _demo_outputs(args: argparse.Namespace) -> list[Path]:
    """What the demo writes: its plot and plan, and its closing offline plan's result, plot
    and plan (``offline.cli.plan_command``'s defaults beside the result)."""
    out = Path(args.out)
    paper = _paper(args)
    return [out, out.with_suffix(".json"), *([] if args.no_paper_plan else [
        paper, paper.with_suffix(".png"), paper.with_suffix(".plan.json")])]


if __name__ == "__main__":
    sys.exit(main())

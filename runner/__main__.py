"""``python -m runner train|sft|report|serve`` — the main job's command line and the local server."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runner._atomic import is_disk_full
from runner.backends import NAMES
from runner.checkpoints import CheckpointError, latest_step
from runner.config import load_config

#: `main`'s exit status after SIGINT (128 + SIGINT, the shell's convention).
INTERRUPTED = 130

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "default.toml"

#: The ``train`` / ``sft`` flags that each set one config key: ``(flag, key, add_argument
#: keywords)``. `main` turns each one given into ``--set key=value`` (before the ``--set`` ones).
KEY_FLAGS: tuple[tuple[str, str, dict], ...] = (
    (
        "--backend",
        "run.backend",
        dict(choices=NAMES, help="trainer backend (default: local)"),
    ),
    ("--name", "run.name", dict(help="run name: outputs go to <output_dir>/<name>")),
    ("--output-dir", "run.output_dir", dict(help="where runs are written (default: runs)")),
    ("--seed", "run.seed", dict(type=int)),
    ("--sft-steps", "sft.steps", dict(type=int)),
    (
        "--data",
        "sft.data",
        dict(help="SFT records (JSONL: chat messages or prompt/completion)"),
    ),
    ("--eval-data", "sft.eval_data", dict(help="held-out SFT records for the eval NLL (JSONL)")),
    (
        "--epochs",
        "sft.epochs",
        dict(type=int, help="SFT epochs over --data (sets the SFT step count)"),
    ),
    ("--rl-steps", "rl.steps", dict(type=int)),
    ("--checkpoint-interval", "checkpoint.interval", dict(type=int)),
    (
        "--env-coef",
        "rl.env_coef",
        dict(type=float, help="ECHO env-loss coefficient (0 = plain GRPO)"),
    ),
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runner", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("train", "SFT warm-up then RL on the task (the main job)"),
        ("sft", "SFT only: on --data, else on the task's demonstrations"),
    ):
        s = sub.add_parser(name, help=help_text)
        s.add_argument(
            "--config", default=None, help="TOML config (default: examples/default.toml)"
        )
        for flag, _, kwargs in KEY_FLAGS:
            s.add_argument(flag, **kwargs)
        s.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
        s.add_argument(
            "--restart",
            action="store_true",
            help="start over a run that was stopped before its first checkpoint",
        )
        s.add_argument(
            "--no-progress",
            action="store_true",
            help="no progress bar (without a terminal: no progress lines on stdout)",
        )
        s.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="override any config value, e.g. --set rl.group_size=4",
        )
    s = sub.add_parser(
        "report", help="a table of runs' headline numbers and one PNG of their curves"
    )
    s.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to compare")
    s.add_argument(
        "--out", default=None, help="the PNG (default: report.png beside the first RUN_DIR)"
    )
    s = sub.add_parser(
        "serve", help="the local training server (tinker SDK wire protocol; docs/serve.md)"
    )
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (0 = ephemeral; default 8000)")
    s.add_argument(
        "--api-key-env",
        default="TINKER_API_KEY",
        help="environment variable holding the API key clients must send (default: TINKER_API_KEY)",
    )
    s.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve base model NAME: the [model] of a config PATH.toml, or a Hugging Face "
        "checkpoint directory PATH (Llama / Qwen2 / Qwen3; repeatable; default: "
        "examples/default.toml as foldloss/default)",
    )
    s.add_argument(
        "--state-dir",
        default="runs/serve",
        help="where trained models' checkpoints are kept across restarts (default: runs/serve)",
    )
    s.add_argument(
        "--long-poll-s",
        type=float,
        default=20.0,
        help="retrieve_future waits this long before answering try_again (default 20)",
    )
    from runner._limits import SERVE_LIMITS

    for flag, default, what in SERVE_LIMITS.values():
        s.add_argument(flag, type=int, default=default, help=f"most {what} (default {default})")
    s.add_argument(
        "--max-loss-nodes",
        type=int,
        default=4096,
        help="the most nodes a custom-loss graph (create_custom_loss) may have (default 4096)",
    )
    s.add_argument(  # test only (runner.serve.ServeConfig.test_cross_entropy): not in --help
        "--test-cross-entropy", default="", choices=("", "skyrl"), help=argparse.SUPPRESS
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="server log level on stderr (requests are logged at info; never their keys or bodies)",
    )
    return p


def _serve(args) -> int:
    from runner._limits import SERVE_LIMITS
    from runner.serve import serve_forever

    try:
        return serve_forever(
            host=args.host,
            port=args.port,
            api_key_env=args.api_key_env,
            models=args.model,
            state_dir=args.state_dir,
            long_poll_s=args.long_poll_s,
            log_level=args.log_level,
            **{name: getattr(args, name) for name in SERVE_LIMITS},
            max_loss_nodes=args.max_loss_nodes,
            test_cross_entropy=args.test_cross_entropy,
        )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _report(args) -> int:
    from runner.report import report

    dirs = [Path(d) for d in args.run_dirs]
    out = Path(args.out) if args.out else dirs[0].resolve().parent / "report.png"
    try:
        report(dirs, out)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "report":
        return _report(args)
    overrides = list(args.set)
    for flag, key, _ in KEY_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            overrides.append(f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}")
    if args.epochs is not None and args.sft_steps is None:
        overrides.append("sft.steps=0")  # the epochs set the step count
    if args.command == "sft":
        overrides.append("rl.steps=0")
    try:
        cfg = load_config(args.config or DEFAULT_CONFIG, overrides)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from runner.train import run

    freeze = _freeze_after_first_step()
    try:
        with _StopAfterStep() as stop:

            def on_step(step: int, record: dict) -> None:
                freeze(step, record)
                stop.check()

            result = run(
                cfg,
                resume=args.resume,
                restart=args.restart,
                # a bar on a terminal; a plain line every few steps in a log
                progress="off" if args.no_progress else ("bar" if sys.stderr.isatty() else "lines"),
                on_step=on_step,
            )
    except (ValueError, CheckpointError, OSError) as exc:
        if is_disk_full(exc):  # a library's own error type included
            oserror = isinstance(exc, OSError)
            where = exc.filename if oserror and exc.filename else _run_dir(cfg)
            why = exc.strerror if oserror and exc.strerror else "No space left on device"
            print(
                f"error: disk full writing {where}: {why}; free space, then {_resume_hint(cfg)}",
                file=sys.stderr,
            )
        elif isinstance(exc, OSError):  # a read-only disk, a missing directory: one line
            where = f" {exc.filename}" if exc.filename else ""
            print(f"error: cannot access{where}: {exc.strerror or exc}", file=sys.stderr)
        else:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: interrupted; {_resume_hint(cfg)}", file=sys.stderr)
        return INTERRUPTED
    _summary(result)
    return 0


class _StopAfterStep:
    """SIGINT during a run: stop after the current step, at a point the run chose.

    Python raises ``KeyboardInterrupt`` wherever the main thread happens to be. Inside an import
    of a C extension it became ``ImportError: initialization failed`` (a traceback, status 1),
    and elsewhere it was lost (the run went on to the end, status 0): both seen with SIGINT
    after a checkpoint. So the first SIGINT only records the request (and says so on stderr);
    `check`, called after each step's metrics and checkpoint, raises ``KeyboardInterrupt``
    there. A second SIGINT raises at once. Outside the main thread nothing is installed.
    """

    NOTICE = b"interrupt: stopping after the current step (Ctrl-C again to stop at once)\n"

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> _StopAfterStep:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            import signal

            signal.signal(signal.SIGINT, self._previous)

    def _handler(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        import os

        os.write(2, self.NOTICE)  # not print(): the handler may run inside another write

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt


def _freeze_after_first_step():
    """An ``on_step`` callback: `runner._gc.freeze_heap` once, after the run's first step.

    By then the imports, the trainer and the first step's compiled executables -- what the
    process keeps until it exits -- are on the heap; later full collections skip them.
    """
    from runner._gc import freeze_heap

    done = []

    def on_step(step: int, record: dict) -> None:
        if not done:
            done.append(freeze_heap())

    return on_step


def _run_dir(cfg) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def _resume_hint(cfg) -> str:
    """What a rerun continues from, after an interrupt."""
    root = _run_dir(cfg) / "checkpoints"
    try:
        step = latest_step(root)
    except CheckpointError as exc:
        return str(exc)
    if step is None:
        return "no checkpoint was written yet: rerun with --restart to start over"
    return f"--resume continues from the checkpoint of step {step} ({root / f'step_{step:06d}'})"


def _summary(result) -> None:
    recs = result.metrics
    evals = [(r["step"], r["eval_reward"]) for r in recs if "eval_reward" in r]
    nlls = [(r["step"], r["sft/eval_nll"]) for r in recs if "sft/eval_nll" in r]
    rl = [r for r in recs if r.get("phase") == "rl"]
    print(f"run directory: {result.run_dir}")
    if evals:
        print(
            "eval reward (held-out problems, sampled): "
            + ", ".join(f"step {s}: {v:.3f}" for s, v in evals)
        )
    if nlls:
        print("eval NLL ([sft].eval_data): " + ", ".join(f"step {s}: {v:.4f}" for s, v in nlls))
    if rl:
        k = max(1, len(rl) // 5)
        first = sum(r["reward"] for r in rl[:k]) / k
        last = sum(r["reward"] for r in rl[-k:]) / k
        print(f"train reward: first {k} RL steps {first:.3f} -> last {k} RL steps {last:.3f}")
    print(f"metrics: {result.run_dir / 'metrics.jsonl'}  plot: {result.run_dir / 'plot.png'}")


def _exit(code: int) -> None:
    """Exits with ``code``; after an interrupt, without the interpreter's teardown.

    The run has unwound (its files closed, its checkpoints committed or never named), and the
    interrupt's one line is printed. A teardown after SIGINT has been seen to end the process by
    the signal instead (status -2, once in a CI run) -- an XLA/LLVM signal handler or a late
    signal; ``os._exit`` makes the status the documented 130 whatever the teardown would do.
    """
    if code != INTERRUPTED:
        sys.exit(code)
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())

"""`distill STAGE -c CONFIG [dotted.key=value ...]` — one entry point, one dispatch table.

Exit codes (CONTRACT.md): 0 done, 1 runtime failure (message + log path), 2 bad config or input (one message,
no traceback, nothing written), 130 interrupted (state saved; rerun resumes).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from types import FrameType

from distill import __version__
from distill.errors import EXIT_INPUT, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, DistillError, Interrupted

log = logging.getLogger("distill")

# stage -> "module:function"; imported lazily so `validate` and `--help` never import torch or vLLM.
STAGES: dict[str, str] = {
    "data": "distill.data.stage:run",
    "train": "distill.train.stage:run",
    "eval": "distill.evaluate.stage:run",
    "publish": "distill.publish.stage:run",
    "run": "distill.pipeline:run",
    "validate": "distill.cli:validate",
}

STAGE_HELP = {
    "data": "build the distillation dataset (target-generated responses, optional top-k logits)",
    "train": "distil the draft on the target's logits",
    "eval": "measure drafts inside vLLM speculative decoding",
    "publish": "export a tuned draft, versioned, with a model card",
    "run": "all four stages, skipping those whose outputs are complete",
    "validate": "resolve + validate the config, print the resolved YAML, touch nothing",
}


def validate(cfg) -> int:  # type: ignore[no-untyped-def]
    from distill.config import to_yaml

    sys.stdout.write(to_yaml(cfg))
    return EXIT_OK


def resolve_stage(name: str) -> Callable[..., int | None]:
    module_name, func = STAGES[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise DistillError(f"stage '{name}' is not built yet in this version of distill.") from exc
        raise
    return getattr(module, func)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distill", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--version", action="version", version=f"distill {__version__}")
    sub = p.add_subparsers(dest="stage", metavar="STAGE")
    for name in STAGES:
        sp = sub.add_parser(name, help=STAGE_HELP[name], description=STAGE_HELP[name])
        sp.add_argument("-c", "--config", required=True, help="YAML config (see configs/)")
        sp.add_argument("overrides", nargs="*", help="dotted.key=value overrides (OmegaConf dotlist)")
    dp = sub.add_parser("docs", help="print the documentation of every config key (from the schema)")
    dp.add_argument(
        "section", nargs="?", help="only this section (run, target, draft, data, train, eval, publish)"
    )
    return p


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Schedulers (SLURM, Kubernetes, systemd) stop jobs with SIGTERM: treat it like Ctrl-C so stages save
    # their state and the process exits 130.
    raise Interrupted(f"received signal {signum}; state saved, rerun the same command to resume.")


def _setup_console_logging(level: str) -> None:
    from rich.logging import RichHandler

    root = logging.getLogger("distill")
    if not any(isinstance(h, RichHandler) for h in root.handlers):
        h = RichHandler(show_path=False, rich_tracebacks=False, markup=False)
        h.setLevel(level.upper())
        root.addHandler(h)
    root.setLevel(logging.DEBUG)
    root.propagate = False


def _log_path_hint() -> str:
    for h in logging.getLogger("distill").handlers:
        if isinstance(h, logging.FileHandler):
            return f" (log: {h.baseFilename})"
    return ""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.stage is None:
        _parser().print_help()
        return EXIT_INPUT
    if args.stage == "docs":
        from distill.config import SECTIONS, docs_markdown

        if args.section and args.section not in SECTIONS:
            print(f"error: unknown section '{args.section}'; one of {', '.join(SECTIONS)}", file=sys.stderr)
            return EXIT_INPUT
        sys.stdout.write(docs_markdown(args.section))
        return EXIT_OK
    if threading_is_main():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        from distill.config import load_config

        cfg = load_config(args.config, args.overrides)
        _setup_console_logging(cfg.run.log_level)
        from distill.precision import notes

        for note in notes():  # what `auto` precision became on this machine
            log.info(note)
        if cfg.run.threads:
            import torch

            torch.set_num_threads(cfg.run.threads)
        result = resolve_stage(args.stage)(cfg)
        return EXIT_OK if result is None else int(result)
    except DistillError as exc:
        if exc.exit_code == EXIT_RUNTIME:
            log.debug("runtime failure", exc_info=True)
        print(f"error: {exc}{_log_path_hint() if exc.exit_code == EXIT_RUNTIME else ''}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(
            "interrupted; state saved where the stage supports it — rerun the same command to resume.",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug or an unexpected runtime failure: message + log path, traceback in log
        log.debug("unexpected failure:\n%s", traceback.format_exc())
        hint = _log_path_hint() or " (rerun with DISTILL_TRACEBACK=1 for the traceback)"
        print(f"error: {type(exc).__name__}: {exc}{hint}", file=sys.stderr)
        if os.environ.get("DISTILL_TRACEBACK"):
            traceback.print_exc()
        return EXIT_RUNTIME
    finally:
        from distill.rundir import detach_log_file

        detach_log_file()


def threading_is_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()

"""The `tierzero` command line: one function per subcommand, registered in COMMANDS.

To add a subcommand, write `add_<name>(subparsers)` that adds its parser and
sets `run=<function(args) -> exit code>`, and append it to COMMANDS.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import yaml

from tierzero.engine.bench.command import add_bench
from tierzero.engine.config import ConfigError, load_config
from tierzero.engine.config.native import as_dict
from tierzero.engine.plan.command import add_plan
from tierzero.engine.train.command import add_train

Subparsers = Any  # argparse's _SubParsersAction is private


def add_config(sub: Subparsers) -> None:
    config = sub.add_parser("config", help="inspect and validate configs")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = config_sub.add_parser(
        "check", help="print the resolved config (every default filled in) or the error",
        description="Load FILE (native YAML/JSON or DeepSpeed JSON; omitted = the embedded "
        "default), print it as native YAML with every default filled in and list the "
        "DeepSpeed keys that were accepted but not acted on. Exit 1 on a bad config.",
    )
    check.add_argument("file", nargs="?", metavar="FILE", help="config file; omit for the default")
    check.add_argument("--auto", action="append", default=[], metavar="NAME=VALUE",
                       help="a Hugging Face training argument for DeepSpeed 'auto' values, "
                       "e.g. --auto learning_rate=2e-5 --auto max_steps=1000 (repeatable)")
    check.set_defaults(run=run_config_check)


def run_config_check(args: argparse.Namespace) -> int:
    # This command prints the ignored DeepSpeed keys itself; the load-time
    # warning would report them a second time. Restored after: main() may run
    # in a longer-lived process (tests, notebooks).
    load_log = logging.getLogger("tierzero.engine.config.load")
    previous = load_log.level
    load_log.setLevel(logging.ERROR)
    try:
        auto = _auto_values(args.auto)
        config = load_config(args.file, auto_values=auto)
    except ConfigError as exc:
        sys.stderr.write(f"tierzero config check: error: {exc}\n")
        return 1
    finally:
        load_log.setLevel(previous)
    where = args.file or "the embedded default (configs/default.yaml)"
    out = [f"# tierzero config resolved from {where} ({config.source} schema)",
           "# every key below is set; this output loads back as a native config"]
    tree = as_dict(config)
    del tree["source"], tree["ignored_keys"], tree["ignored_reasons"], tree["run_length_auto"]
    out.append(yaml.safe_dump(tree, sort_keys=False, default_flow_style=False).rstrip())
    if config.run_length_auto:
        out.append("# 'auto' waiting for the run length (tierzero train: train.steps; or "
                   "--auto max_steps=N): " + ", ".join(k for k, _ in config.run_length_auto))
    if config.ignored_keys:
        out.append("# DeepSpeed keys accepted but not acted on:")
        out.extend(f"#   {key} ({why})"
                   for key, why in zip(config.ignored_keys, config.ignored_reasons, strict=True))
    elif config.source == "deepspeed":
        out.append("# DeepSpeed keys accepted but not acted on: none")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def _auto_values(pairs: Sequence[str]) -> dict[str, Any]:
    auto: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise ConfigError("--auto", f"{pair!r} is not allowed; allowed: NAME=VALUE, e.g. "
                              "max_steps=1000")
        auto[name.strip()] = _scalar(text.strip())
    return auto


def _scalar(text: str) -> Any:
    # A number or true/false/null as written on a command line ("3e-4" included).
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def add_consolidate(sub: Subparsers) -> None:
    cons = sub.add_parser(
        "consolidate", help="write a checkpoint's full weights as Hugging Face safetensors",
        description="Stream the parameters of checkpoint CKPT (a directory written by "
        "save_checkpoint; its `latest` tag unless --tag) into OUT as safetensors, tensor by "
        "tensor: model.safetensors, or model-0000i-of-0000N.safetensors with "
        "model.safetensors.index.json above --max-shard-size; config.json too when the model "
        "had a Hugging Face config. Exit 1 on a missing or damaged checkpoint.")
    cons.add_argument("ckpt", metavar="CKPT", help="checkpoint directory")
    cons.add_argument("out", metavar="OUT", help="output directory (created)")
    cons.add_argument("--tag", default=None, help="checkpoint tag (default: CKPT/latest)")
    cons.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                      help="output dtype (default fp32, from the fp32 master weights)")
    cons.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                      help="bytes per output file, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    cons.add_argument("--no-verify", action="store_true",
                      help="skip the CRC-32 check of the checkpoint files (sizes still checked)")
    cons.set_defaults(run=run_consolidate)


def run_consolidate(args: argparse.Namespace) -> int:
    from tierzero.engine.checkpoint.consolidate import OUT_DTYPES, consolidate_to_safetensors
    from tierzero.engine.checkpoint.layout import CheckpointError
    from tierzero.engine.config.values import parse_bytes

    try:
        max_shard = parse_bytes(args.max_shard_size, "--max-shard-size", int, {"unit": "bytes"})
        files = consolidate_to_safetensors(
            args.ckpt, args.out, args.tag, dtype=OUT_DTYPES[args.dtype],
            max_shard_bytes=max_shard, verify=not args.no_verify)
    except (CheckpointError, ConfigError, ValueError, OSError) as exc:
        sys.stderr.write(f"tierzero consolidate: error: {exc}\n")
        return 1
    sys.stdout.write("".join(f"{f}\n" for f in files))
    return 0


COMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    add_train, add_plan, add_bench, add_consolidate, add_config,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierzero", description="ZeRO-3 training with GPU / host / NVMe offload.")
    parser.add_argument("--debug", action="store_true",
                        help="show the Python traceback of an unexpected error (anywhere on "
                        "the command line)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:  # accepted after the subcommand too: moved where argparse wants it
        argv = ["--debug", *(a for a in argv if a != "--debug")]
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except Exception as exc:  # every other error as one line; the traceback under --debug
        if args.debug:
            raise
        sys.stderr.write(f"{_command_name(args)}: error: {_one_line(exc)} "
                         "(run with --debug for the traceback)\n")
        code = 1
    if args.command == "train" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        leave_without_finalizing(code)
    return code


def _command_name(args: argparse.Namespace) -> str:
    action = getattr(args, "config_command", None)
    return " ".join(["tierzero", args.command, *([action] if action else [])])


def _one_line(exc: BaseException) -> str:
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def leave_without_finalizing(code: int) -> NoReturn:
    """End a torchrun rank once its outputs are written and its process group destroyed,
    skipping interpreter finalization: gloo's threads can still hold finished work whose
    tensors need the GIL, and freeing them while the interpreter tears down aborts the
    process ("terminate called without an active exception", pytorch/pytorch#179291),
    which torchrun reports as a failed run although training finished."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

"""``timeshare pull SOURCE [--id ID] [--dir DIR] [--quant Q] [--max-size SIZE]``: get a model and add it.

SOURCE is a Hugging Face repo (``user/repo``, ``user/repo:Q4_K_M``, ``user/repo/file.gguf``;
``hf.co/`` in front is fine) or the ``http(s)://`` URL of a ``.gguf`` file. The work is
``core/pull/``'s; this prints the choices, the progress (stderr) and the outcome, adds the model
to the config, and asks a running Timeshare to pick it up (``POST /timeshare/v1/reload``).
``--max-size`` raises the cap on a file whose size the server does not say (64 GiB).

Exit status: 0 done (also when the model was there already), 1 failed, 2 a usage problem (a bad
source, several quantisations and no ``--quant`` without a terminal to ask on), 130 interrupted
(what was downloaded is kept when the server can resume it: the same command resumes).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from .core.config.files import cli_config_path
from .core.errors import CancelledError, ChooseQuantisationError, ConfigError, TimeshareError
from .core.pull import add, download, progress, remote, sources
from .core.util.units import human_bytes, parse_size

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class ProgressPrinter:
    """Progress lines on ``err``: one line redrawn in place on a terminal, else a line every 10 %
    (or 10 s)."""

    def __init__(self, err: TextIO) -> None:
        self.err = err
        self.tty = err.isatty()
        self.width = 0
        self.last_step = -1
        self.last_time = 0.0

    def __call__(self, p: progress.Progress) -> None:
        line = p.describe()
        if self.tty:
            pad = max(0, self.width - len(line))
            self.err.write("\r  " + line + " " * pad)
            self.width = len(line)
            self.err.flush()
            return
        fraction = p.fraction
        step = int(fraction * 10) if fraction is not None else -1
        now = time.monotonic()
        if step != self.last_step or now - self.last_time >= 10.0:
            self.last_step = step
            self.last_time = now
            self.err.write("  " + line + "\n")
            self.err.flush()

    def end(self) -> None:
        if self.tty and self.width:
            self.err.write("\n")
            self.err.flush()
            self.width = 0


def _print_choices(choices: Sequence[sources.Choice], err: TextIO) -> None:
    rows = [("", "QUANT", "SIZE", "FILE")]
    for i, c in enumerate(choices, 1):
        files = c.filename + (f" (+{len(c.files) - 1} parts)" if len(c.files) > 1 else "")
        rows.append((str(i), c.label, human_bytes(c.size or 0, empty="?"), files))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        err.write("  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() + "\n")


def _ask(count: int, err: TextIO) -> int | None:
    """The number the user types (1..count), or None at end of input."""
    while True:
        err.write(f"Which one? [1-{count}] ")
        err.flush()
        line = sys.stdin.readline()
        if not line:
            return None
        line = line.strip()
        if line.isdigit() and 1 <= int(line) <= count:
            return int(line) - 1


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        source = sources.parse_source(args.source, args.quant)
        max_size = parse_size(args.max_size) if getattr(args, "max_size", None) else None
    except ValueError as exc:
        err.write(f"timeshare pull: {exc}\n")
        return EXIT_USAGE
    printer = ProgressPrinter(err)
    mmproj: Path | None = None  # the repo's vision projector, pulled beside the model
    try:
        err.write(f"Looking up {source}…\n")
        listing = remote.list_source(source)
        try:
            choice = sources.choose(listing, args.quant)
        except ChooseQuantisationError as exc:
            err.write(f"{listing.title} has {len(listing.choices)} quantisations:\n")
            _print_choices(listing.choices, err)
            if not sys.stdin.isatty():
                err.write(
                    f"timeshare pull: pick one with --quant QUANT (or {listing.title}:QUANT), e.g. "
                    f"--quant {exc.choices[0]}\n"
                )
                return EXIT_USAGE
            index = _ask(len(listing.choices), err)
            if index is None:
                return EXIT_USAGE
            choice = listing.choices[index]
        size = human_bytes(choice.size or 0, empty="size unknown")
        parts = f" in {len(choice.files)} parts" if len(choice.files) > 1 else ""
        err.write(f"Getting {choice.filename} ({choice.label}, {size}{parts}) from {listing.title}\n")
        result = download.pull(listing, choice, dest_dir=args.dir, progress=printer, max_size=max_size)
        printer.end()
        entry = result.entry
        checks = "size, sha256" if any(f.sha256 for f in choice.files) else "size"
        arch = "architecture" if result.architecture_checked else "architecture (approximate list)"
        err.write(
            f"Checked {checks}, GGUF header and {arch}: {entry.architecture}, {entry.quantisation}"
            f"{', licence ' + entry.licence if entry.licence else ''}\n"
        )
        projector = sources.projector_choice(listing)
        if projector is not None:  # the model reads images with it (issue 41)
            size = human_bytes(projector.size or 0, empty="size unknown")
            err.write(f"Getting its vision projector {projector.filename} ({size})\n")
            got = download.pull_projector(listing, dest_dir=args.dir, progress=printer)
            printer.end()
            mmproj = got.path if got is not None else None
    except CancelledError:
        printer.end()
        err.write("timeshare pull: cancelled; run the same command again (it resumes where it can)\n")
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        printer.end()
        err.write(
            "\ntimeshare pull: interrupted; what was downloaded is kept when the server can resume it: "
            "run the same command to resume\n"
        )
        return EXIT_INTERRUPTED
    except TimeshareError as exc:
        printer.end()
        err.write(f"timeshare pull: {exc}\n")
        return EXIT_FAILED
    config_path = cli_config_path(getattr(args, "config", None))
    try:
        _config, model, added = add.add_to_config(
            result, config_path, model_id=args.id, name=getattr(args, "name", None), mmproj=mmproj
        )
    except ConfigError as exc:
        err.write(f"timeshare pull: the model is in {result.path}, but it was not added: {exc}\n")
        return EXIT_FAILED
    if added:
        seeing = f", reads images with {model.mmproj}" if model.mmproj else ""
        out.write(f"Added model {model.id} ({model.display_name}, {result.path}{seeing}) to {config_path}\n")
    else:
        out.write(f"{result.path} is already configured as model {model.id} in {config_path}\n")
    out.flush()
    if added:  # nothing changed in the config: nothing to reload
        _reload(args, model.id, err)
    return EXIT_OK


def _reload(args: argparse.Namespace, model_id: str, err: TextIO) -> None:
    """Tell a running Timeshare to re-read its config; say what happened (never fails the pull)."""
    from .connection import ClientError, reload_instance

    try:
        answer = reload_instance(args)
    except ClientError as exc:
        err.write(f"timeshare pull: could not tell the running Timeshare to reload: {exc}\n")
        return
    if answer is None:
        err.write(
            "No running Timeshare to reload (none records an API address): it serves the model "
            "when it starts (`timeshare` or `timeshare serve`).\n"
        )
    elif model_id in (answer.get("models") or []):
        err.write(f"The running Timeshare reloaded its configuration and starts {model_id}.\n")
    else:
        err.write(
            f"The running Timeshare reloaded {answer.get('config', 'its configuration')}, which does not "
            f"list {model_id}: it was started with another --config.\n"
        )


def main(args: argparse.Namespace) -> int:
    return run(args, sys.stdout, sys.stderr)

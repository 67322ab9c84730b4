"""Static shell completions (bash, zsh, fish) for `kvctl` and `kvtop`, generated from their CLIs.

Static rather than typer's call-back scripts: a TAB must not start Python. The scripts are
checked in under `completions/` (`make completions` rewrites them; a test fails when they are
stale). The command trees are read from the two typer apps (`kvtop.ctl.cli.app`,
`kvtop.dashboard.cli.cli`); choices the CLIs keep as plain strings come from the constants in
`kvtop.protocol.config`.
"""

from __future__ import annotations

import enum
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Annotated, Literal, get_args, get_origin

import typer

from kvtop.entry import CLIError
from kvtop.protocol.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    SCHEDULE_POLICIES,
    TRIGGERS,
)

SHELLS = ("bash", "zsh", "fish")
FILE_NAMES = {"bash": "{prog}.bash", "zsh": "_{prog}", "fish": "{prog}.fish"}
VALUE_CHOICES = {
    "--dtype": DTYPES,
    "--kv-cache-dtype": KV_CACHE_DTYPES,
    "--attention-backend": ATTENTION_BACKENDS,
    "--schedule-policy": SCHEDULE_POLICIES,
    "--preemption-mode": PREEMPTION_MODES,
    "--snapshot-on": TRIGGERS,
    "--log-level": ("critical", "error", "warning", "info", "debug"),
}
PATH_OPTIONS = {"--model", "--socket", "--output", "--snapshot-dir", "--replay"}
ARG_CHOICES = {"shell": SHELLS}


@dataclass
class Opt:
    names: list[str]
    help: str = ""
    takes_value: bool = False
    choices: tuple[str, ...] = ()
    path: bool = False


@dataclass
class Cmd:
    name: str
    help: str = ""
    options: list[Opt] = field(default_factory=list)
    args: list[tuple[str, tuple[str, ...], bool]] = field(default_factory=list)  # (name, choices, path)
    subcommands: list[Cmd] = field(default_factory=list)


def _first_sentence(text: str | None) -> str:
    text = " ".join((text or "").split())
    text = text.replace("|", "/").replace(":", ",")
    text = re.sub(r"[\[\]`'\"$\\;&<>(){}]", "", text)
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    return (m.group(1) if m else text)[:80]


def _opt(names: list[str], help: str, takes_value: bool, choices=(), path=False) -> Opt:
    long = next((n for n in names if n.startswith("--")), names[0])
    choices = tuple(choices) or VALUE_CHOICES.get(long, ())
    return Opt(names, _first_sentence(help), takes_value, tuple(choices), path or long in PATH_OPTIONS)


# ---- reading a CLI -----------------------------------------------------------------------
def _value_kind(param) -> tuple[tuple[str, ...], bool]:
    """(choices, is a path) of a click parameter, or of typer's own (which keeps the annotation)."""
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is not None:
        ann = descriptor.annotation
        if isinstance(ann, type) and issubclass(ann, enum.Enum):
            return tuple(str(e.value) for e in ann), False
        if get_origin(ann) is Literal:
            return tuple(str(a) for a in get_args(ann)), False
        return (), isinstance(ann, type) and issubclass(ann, PurePath)
    ptype = getattr(param, "type", None)
    return tuple(getattr(ptype, "choices", ()) or ()), type(ptype).__name__ in ("Path", "File")


def from_click(command, name: str) -> Cmd:
    """A click (or typer's vendored click) command tree."""
    cmd = Cmd(name, _first_sentence(getattr(command, "help", None) or getattr(command, "short_help", None)))
    for p in command.params:
        if getattr(p, "hidden", False):
            continue
        choices, path = _value_kind(p)
        if p.param_type_name == "argument":
            cmd.args.append((p.name, choices or ARG_CHOICES.get(p.name, ()), path))
            continue
        takes_value = not getattr(p, "is_flag", False) and not getattr(p, "count", False)
        cmd.options.append(_opt(list(p.opts), p.help or "", takes_value, choices, path))
        if p.secondary_opts:
            cmd.options.append(_opt(list(p.secondary_opts), p.help or "", False))
    cmd.options.append(Opt(["--help"], "Show help and exit."))
    if hasattr(command, "list_commands"):  # a group: ask it, so lazily loaded commands are there too
        for sub_name in sorted(command.list_commands(None)):
            sub = command.get_command(None, sub_name)
            if sub is not None and not getattr(sub, "hidden", False):
                cmd.subcommands.append(from_click(sub, sub_name))
    return cmd


def kvctl_command() -> Cmd:
    from kvtop.ctl.cli import app

    return from_click(typer.main.get_command(app), "kvctl")


def kvtop_command() -> Cmd:
    from kvtop.dashboard.cli import cli

    return from_click(typer.main.get_command(cli), "kvtop")


# ---- writing scripts ---------------------------------------------------------------------
def _header(prog: str, shell: str) -> str:
    return f"# {shell} completion for {prog} — generated from its CLI by `make completions`; do not edit."


def _names(opts: list[Opt]) -> str:
    return " ".join(n for o in opts for n in o.names)


def _case_arms(subcommands: list[Cmd], body: Callable[[Cmd, str], list[str]], indent: str) -> list[str]:
    """One `name) … ;;` arm of a shell `case` per subcommand, its body one step further in."""
    lines = []
    for sub in subcommands:
        lines += [f"{indent}{sub.name})", *body(sub, indent + "    "), f"{indent}    ;;"]
    return lines


def _bash_cmd_body(cmd: Cmd, indent: str) -> list[str]:
    lines = [f'{indent}case "$prev" in']
    for o in cmd.options:
        if not o.takes_value:
            continue
        pat = "|".join(o.names)
        if o.choices:
            action = f'COMPREPLY=( $(compgen -W "{" ".join(o.choices)}" -- "$cur") )'
        elif o.path:
            action = 'COMPREPLY=( $(compgen -f -- "$cur") )'
        else:
            action = "COMPREPLY=()"
        lines.append(f"{indent}    {pat}) {action}; return 0 ;;")
    lines.append(f"{indent}esac")
    lines.append(f'{indent}if [[ "$cur" == -* ]]; then')
    lines.append(f'{indent}    COMPREPLY=( $(compgen -W "{_names(cmd.options)}" -- "$cur") )')
    arg_choices = next((c for _, c, _ in cmd.args if c), ())
    if arg_choices:
        lines.append(f"{indent}else")
        lines.append(f'{indent}    COMPREPLY=( $(compgen -W "{" ".join(arg_choices)}" -- "$cur") )')
    elif any(path for _, _, path in cmd.args):
        lines.append(f"{indent}else")
        lines.append(f'{indent}    COMPREPLY=( $(compgen -f -- "$cur") )')
    lines.append(f"{indent}fi")
    return lines


def bash_script(cmd: Cmd) -> str:
    fn = f"_{cmd.name}_complete"
    lines = [
        _header(cmd.name, "bash"),
        f"# Install: source this file from ~/.bashrc, or copy it to ~/.local/share/bash-completion/completions/{cmd.name}",
        f"{fn}() {{",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}" sub="" i',
    ]
    if cmd.subcommands:
        lines += [
            "    for ((i = 1; i < COMP_CWORD; i++)); do",
            '        case "${COMP_WORDS[i]}" in',
            "            -*) ;;",
            '            *) sub="${COMP_WORDS[i]}"; break ;;',
            "        esac",
            "    done",
            '    case "$sub" in',
            '        "")',
            f'            COMPREPLY=( $(compgen -W "{" ".join(s.name for s in cmd.subcommands)} {_names(cmd.options)}" -- "$cur") )',
            "            ;;",
        ]
        lines += _case_arms(cmd.subcommands, _bash_cmd_body, " " * 8)
        lines.append("    esac")
    else:
        lines += _bash_cmd_body(cmd, "    ")
    lines += ["    return 0", "}", f"complete -o default -F {fn} {cmd.name}", ""]
    return "\n".join(lines)


def _zsh_opt(o: Opt) -> str:
    desc = o.help.replace("'", "")
    if o.choices:
        value = f":{o.names[-1].lstrip('-')}:({' '.join(o.choices)})"
    elif o.path:
        value = f":{o.names[-1].lstrip('-')}:_files"
    elif o.takes_value:
        value = f":{o.names[-1].lstrip('-')}: "
    else:
        value = ""
    if len(o.names) == 1:
        return f"'{o.names[0]}[{desc}]{value}'"
    excl = " ".join(o.names)
    return f"'({excl})'{{{','.join(o.names)}}}'[{desc}]{value}'"


def _zsh_args(cmd: Cmd, indent: str) -> list[str]:
    specs = [_zsh_opt(o) for o in cmd.options]
    for i, (name, choices, path) in enumerate(cmd.args, 1):
        action = f"({' '.join(choices)})" if choices else ("_files" if path else " ")
        specs.append(f"'{i}:{name}:{action}'")
    if not specs:
        return [f"{indent}_message 'no more arguments'"]
    out = [f"{indent}_arguments -s \\"]
    out += [f"{indent}    {s} \\" for s in specs[:-1]]
    out.append(f"{indent}    {specs[-1]}")
    return out


def zsh_script(cmd: Cmd) -> str:
    fn = f"_{cmd.name}"
    lines = [
        f"#compdef {cmd.name}",
        _header(cmd.name, "zsh"),
        f"# Install: copy this file as {fn} into a directory on $fpath.",
        "",
    ]
    lines.append(f"{fn}() {{")
    if cmd.subcommands:
        lines.append("    local -a commands")
        lines.append("    commands=(")
        for s in cmd.subcommands:
            lines.append(f"        '{s.name}:{s.help.replace(chr(39), '')}'")
        lines.append("    )")
        lines.append('    local curcontext="$curcontext" state line')
        root = [_zsh_opt(o) for o in cmd.options] + ["'1: :->command'", "'*:: :->args'"]
        lines.append("    _arguments -C \\")
        lines += [f"        {s} \\" for s in root[:-1]]
        lines.append(f"        {root[-1]}")
        lines.append("    case $state in")
        lines.append(f"        command) _describe -t commands '{cmd.name} command' commands ;;")
        lines.append("        args)")
        lines.append("            case $words[1] in")
        lines += _case_arms(cmd.subcommands, _zsh_args, " " * 16)
        lines.append("            esac")
        lines.append("            ;;")
        lines.append("    esac")
    else:
        lines += _zsh_args(cmd, "    ")
    lines += ["}", "", f'{fn} "$@"', ""]
    return "\n".join(lines)


def _fish_lines(prog: str, cmd: Cmd, cond: str) -> list[str]:
    lines = []
    for o in cmd.options:
        parts = [f"complete -c {prog}"]
        if cond:
            parts.append(f"-n '{cond}'")
        for n in o.names:
            parts.append(f"-l {n[2:]}" if n.startswith("--") else f"-s {n[1:]}")
        if o.choices:
            parts.append(f"-x -a '{' '.join(o.choices)}'")
        elif o.path:
            parts.append("-r -F")
        elif o.takes_value:
            parts.append("-x")
        if o.help:
            parts.append(f"-d '{o.help}'")
        lines.append(" ".join(parts))
    for _, choices, path in cmd.args:
        base = f"complete -c {prog}" + (f" -n '{cond}'" if cond else "")
        if choices:
            lines.append(f"{base} -x -a '{' '.join(choices)}'")
        elif path:
            lines.append(f"{base} -F")
    return lines


def fish_script(cmd: Cmd) -> str:
    prog = cmd.name
    lines = [
        _header(prog, "fish"),
        f"# Install: copy this file to ~/.config/fish/completions/{prog}.fish",
        f"complete -c {prog} -f",
    ]
    if cmd.subcommands:
        names = " ".join(s.name for s in cmd.subcommands)
        lines += _fish_lines(prog, Cmd(prog, options=cmd.options), f"not __fish_seen_subcommand_from {names}")
        for s in cmd.subcommands:
            lines.append(f"complete -c {prog} -n 'not __fish_seen_subcommand_from {names}' -a {s.name} -d '{s.help}'")
        for s in cmd.subcommands:
            lines += _fish_lines(prog, s, f"__fish_seen_subcommand_from {s.name}")
    else:
        lines += _fish_lines(prog, cmd, "")
    return "\n".join(lines) + "\n"


RENDERERS = {"bash": bash_script, "zsh": zsh_script, "fish": fish_script}


def completion_command(
    shell: Annotated[str, typer.Argument(help="bash, zsh or fish.")],
    prog: Annotated[str, typer.Option(help="The program to complete: kvctl or kvtop.")] = "kvctl",
) -> None:
    """Print a shell completion script (see README: Shell completion)."""
    try:
        sys.stdout.write(script(prog, shell))
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def script(prog: str, shell: str) -> str:
    if shell not in RENDERERS:
        raise ValueError(f"unknown shell {shell!r}: use {', '.join(SHELLS)}")
    if prog not in ("kvctl", "kvtop"):
        raise ValueError(f"unknown program {prog!r}: use kvctl or kvtop")
    return RENDERERS[shell](kvctl_command() if prog == "kvctl" else kvtop_command())


def generate(out_dir: Path) -> list[Path]:
    """Write every script into `out_dir`; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for prog, cmd in (("kvctl", kvctl_command()), ("kvtop", kvtop_command())):
        for shell in SHELLS:
            path = out_dir / FILE_NAMES[shell].format(prog=prog)
            path.write_text(RENDERERS[shell](cmd))
            written.append(path)
    return written


if __name__ == "__main__":  # make completions
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("completions")
    for p in generate(target):
        print(p)

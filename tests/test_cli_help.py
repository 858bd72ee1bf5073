"""The command line's help: it reads without broken lines at 80 columns, and docs/cli.md is what the CLI generates."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH = 80


def render_help(*args: str) -> str:
    """``mlxcluster ARGS --help`` as an 80-column terminal shows it (typer's runner, in this process)."""
    from typer.testing import CliRunner

    from mlxcluster.cli import app

    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": str(WIDTH), "TERMINAL_WIDTH": str(WIDTH)})
    assert result.exit_code == 0, result.output
    return result.stdout


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def broken_lines(text: str, width: int = WIDTH) -> list:
    """The places where ``text`` (rich's rendering of a help page) breaks a paragraph with a hard
    newline: a line of a paragraph (or of one table cell) followed by a line of the same paragraph
    whose first word would have fit at its end -- a soft wrap only moves a word that does not fit.
    Rich's own ``[default: ...]`` / ``[env var: ...]`` lines are not prose.  Returns
    ``"LINE / NEXT"`` strings."""
    found = []
    lines = text.splitlines()
    for a, b in zip(lines, lines[1:]):
        in_panel = a.startswith("│") and b.startswith("│")
        if in_panel:
            a, b, room = a[1:].rstrip("│").rstrip(), b[1:].rstrip("│").rstrip(), width - 2 - 1
        elif a.startswith(("│", "╭", "╰")) or b.startswith(("│", "╭", "╰")):
            continue
        else:
            a, b, room = a.rstrip(), b.rstrip(), width - 1
        if not a.strip() or not b.strip() or b.lstrip().startswith("["):
            continue
        c = _indent(b)
        if in_panel:  # a table row starts at the panel's first column; its cells' next lines are indented
            same_cell = c > 1 and len(a) > c and a[c - 1] == " " and a[c] != " "
        else:  # a paragraph's lines start at one column
            same_cell = c == _indent(a)
        word = b.split()[0]
        if same_cell and len(a) + 1 + len(word) <= room:
            found.append(f"{a.strip()} / {b.strip()}")
    return found


def test_broken_lines_finds_a_hard_break_and_not_a_soft_wrap():
    wrapped = " Rank every plan for a cluster -- each node alone, TP, pipelines, TP x PP, PD\n -- by predicted decode\n"
    assert broken_lines(wrapped) == []  # "--" did not fit after "PD"
    hard = " Rank every plan for a cluster -- each node alone, TP,\n pipelines and PD.\n"
    assert broken_lines(hard) == ["Rank every plan for a cluster -- each node alone, TP, / pipelines and PD."]
    panel = ("│ --model      <str>  A .gguf file or mlx-lm model                             │\n"
             "│                     directory.                                               │\n"
             "│ --world-size <int>  Ranks.                                                   │\n")
    assert broken_lines(panel) == ["--model      <str>  A .gguf file or mlx-lm model / directory."]


def _commands() -> list:
    import typer.main

    from mlxcluster.cli import app

    return list(typer.main.get_command(app).commands)


@pytest.mark.parametrize("command", [None, *_commands()])
def test_help_reads_without_broken_lines_at_80_columns(command):
    text = render_help(*([command] if command else []))
    assert max(len(line) for line in text.splitlines()) <= WIDTH  # rendered at 80 columns indeed
    assert broken_lines(text) == [], f"mlxcluster {command or ''} --help breaks a paragraph:\n{text}"


def _gen_cli_docs():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", os.path.join(ROOT, "scripts", "gen_cli_docs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_cli_md_is_what_the_cli_generates():
    gen = _gen_cli_docs()
    with open(gen.OUT, encoding="utf-8") as f:
        committed = f.read()
    assert committed == gen.render(), "docs/cli.md is stale: run python scripts/gen_cli_docs.py"


def test_docs_cli_md_lists_every_command_and_flag():
    import typer.main

    from mlxcluster.cli import app

    text = _gen_cli_docs().render()
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        section = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        for param in command.params:
            for flag in param.opts if param.param_type_name == "option" else [param.name.upper()]:
                assert f"`{flag}`" in section, (name, flag)
    assert "| `--kv-bits` | int |  | Quantize the KV caches" in text

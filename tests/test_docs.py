"""The docs cannot drift from the code: every Hydra override in a command of a fenced shell block of README.md,
DEVELOPERS.md and docs/*.md composes against conf/ and passes train.py's checks that need no files, every relative
link resolves (its ``#anchor`` to a heading) inside the repository, every ``docs/...`` path a doc or a source file
cites exists (with its ``#anchor``), code cites docs/results.md and never the lab log, every page of docs/ is linked
from README.md or DEVELOPERS.md, every script is in the README's repository layout, every key of the schema is in
docs/configuration.md, and every figure the README's results sections quote is a figure of docs/results.md (the page
of current measurements): a workload's current (bold) figure, once, or an anchor's.

Which commands: a line (backslash continuations joined, ``&&`` / ``;`` / ``|`` / ``&`` splitting it) whose command
word is ``python``/``python3``/``torchrun`` running ``train.py``, ``scripts/plan.py`` or ``scripts/bench.py``, or
``sbatch``/``bash``/``srun`` (or the script itself) running a ``scripts/slurm/`` script; its overrides are the
``key=value`` tokens after the script. ``NAME=value`` assignments earlier in the block are expanded (``$NAME``).
Placeholders: a bare ``...`` or any token without ``=`` is not an override (flags, paths); a value with ``<...>``,
``$`` or ``...`` in it is a placeholder, so only its key is checked (and the command is composed, not validated).
Under ``-m`` every sweep value is composed. ``plan.*`` goes to scripts/plan.py's ``PlanConfig``; a bench.py
command's grid cells are built by bench.py itself. Validation: ``training.config.validate`` (a ``FileNotFoundError``
passes: the docs name files on the reader's machine), the preset's architecture (``model.arch.*``), and the layout
against the world size where the command states one (torchrun's, ``launch.nproc_per_node``, ``plan.gpus``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

import parallelisms
from tests.conftest import CONF_DIR, REPO
from training.config import TrainConfig, register_schema, to_train_config, validate
from training.planner import PlanConfig
from training import startup

DOC_FILES = [REPO / "README.md", REPO / "DEVELOPERS.md", *sorted((REPO / "docs").rglob("*.md"))]  # the lab log too
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
PYTHON_ENTRIES = ("train.py", "scripts/plan.py", "scripts/bench.py")
PYTHON_COMMANDS = {"python", "python3", "torchrun"}
SHELL_COMMANDS = {"sbatch", "bash", "srun"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
_ABSENT = object()


@dataclass(frozen=True)
class Command:
    doc: Path
    line: int  # 1-based, the command's first line
    launcher: tuple[str, ...]  # the words before the script: python, torchrun --nproc_per_node 8, sbatch ...
    entry: str  # the script: train.py, scripts/plan.py, ...
    args: tuple[str, ...]  # the words after it

    @property
    def overrides(self) -> tuple[str, ...]:
        return tuple(w for w in self.args if "=" in w and not w.startswith("-"))

    @property
    def multirun(self) -> bool:
        return "-m" in self.args or "--multirun" in self.args

    @property
    def where(self) -> str:
        return f"{_shown(self.doc)}:{self.line}"


def _shown(doc: Path) -> str:
    return str(doc.relative_to(REPO)) if doc.is_relative_to(REPO) else doc.name


# --------------------------------------------------------------------------------------------------- parsing

def fenced_blocks(text: str) -> Iterator[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of every fenced code block."""
    lines, block, start, language = text.split("\n"), None, 0, ""
    for number, line in enumerate(lines, 1):
        fence = re.match(r"\s*(```+|~~~+)\s*([\w+-]*)", line)
        if fence and block is None:
            block, start, language = [], number + 1, fence.group(2).lower()
        elif fence and block is not None:
            yield language, start, block
            block = None
        elif block is not None:
            block.append(line)


def logical_lines(block: list[str], start: int) -> Iterator[tuple[int, str]]:
    """Lines with their backslash continuations joined, numbered by their first line."""
    pending, first = "", start
    for number, line in enumerate(block, start):
        if not pending:
            first = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield first, pending + line
        pending = ""
    if pending:
        yield first, pending


def _is_assignment(token: str) -> bool:
    return re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", token, re.S) is not None


def _entry(words: list[str]) -> tuple[int, str] | None:
    """The index and name of the Hydra script a command runs, or None."""
    if not words:
        return None
    if words[0] in PYTHON_COMMANDS:
        for i, word in enumerate(words[1:], 1):
            if word.endswith(".py"):
                return next(((i, e) for e in PYTHON_ENTRIES if word == e or word.endswith("/" + e)), None)
        return None
    scripts = [i for i, w in enumerate(words) if w.startswith("scripts/slurm/") and w.endswith((".sbatch", ".sh"))]
    if scripts and (words[0] in SHELL_COMMANDS or scripts[0] == 0):
        return scripts[0], words[scripts[0]]
    return None


def commands(doc: Path, text: str | None = None) -> Iterator[Command]:
    """Every command of ``doc``'s shell blocks that runs a Hydra script, with its overrides."""
    text = doc.read_text() if text is None else text
    for language, start, block in fenced_blocks(text):
        if language not in SHELL_LANGUAGES:
            continue
        variables: dict[str, str] = {}
        for number, line in logical_lines(block, start):
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError as e:  # unbalanced quotes: a problem only in a line that runs a script
                if any(entry in line for entry in PYTHON_ENTRIES + ("scripts/slurm/",)):
                    raise ValueError(f"{_shown(doc)}:{number}: cannot split the command ({e}): {line.strip()}") from e
                continue
            for words in _split_on_separators(tokens):
                words = _expand(_strip_assignments(words, variables), variables)
                found = _entry(words)
                if found is not None:
                    i, entry = found
                    yield Command(doc, number, tuple(words[:i]), entry, tuple(words[i + 1:]))


def _expand(words: list[str], variables: dict[str, str]) -> list[str]:
    """``$NAME`` / ``${NAME}`` of the block's earlier assignments substituted (a whole-word one split into words,
    as the shell does)."""
    out = []
    for word in words:
        whole = re.fullmatch(r"\$\{?(\w+)\}?", word)
        if whole and whole.group(1) in variables:
            out.extend(variables[whole.group(1)].split())
        else:
            out.append(re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), word))
    return out


def _split_on_separators(tokens: list[str]) -> Iterator[list[str]]:
    """The commands of a line: split at ``&&``, ``;``, ``|``, ``&`` (also a ``;`` ending a word)."""
    words: list[str] = []
    for token in tokens:
        if token in SEPARATORS or (token.endswith(";") and len(token) > 1):
            if token not in SEPARATORS:
                words.append(token[:-1])
            yield words
            words = []
        else:
            words.append(token)
    yield words


def _strip_assignments(words: list[str], variables: dict[str, str]) -> list[str]:
    """The command without its leading ``export`` / ``NAME=value`` words, which are recorded."""
    i = 1 if words[:1] == ["export"] else 0
    while i < len(words) and _is_assignment(words[i]):
        name, value = words[i].split("=", 1)
        variables[name] = " ".join(_expand([value], variables))
        i += 1
    return words[i:]


# --------------------------------------------------------------------------------------------------- checking

def _is_placeholder(value: str) -> bool:
    return "..." in value or "$" in value or re.search(r"<[^>]*>", value) is not None


def expand_sweeps(overrides: list[str], multirun: bool) -> list[list[str]]:
    """One override list per job: under ``-m``, the product of every sweep's values."""
    if not multirun:
        return [overrides]
    choices = []
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        values = (list(override.sweep_string_iterator()) if override.is_sweep_override()
                  else [override.get_value_element_as_str()])
        choices.append([f"{key}={v}" for v in values])
    return [list(job) for job in itertools.product(*choices)]


def _validate(cfg: TrainConfig, world: int | None) -> None:
    """train.py's checks that need no files: the config, the preset's architecture (``model.arch.*``), and the
    layout against the world size where the command gives one."""
    try:
        validate(cfg)
    except FileNotFoundError:  # a file on the reader's machine (my_chats.jsonl, /data/...): the data keys are right
        # The data's own checks ran before its files'; the rest of validate runs on the bundled corpus instead.
        bundled = dataclasses.replace(cfg.data, name="chitchat", path=None, sources=None, column=None, eos_id=None)
        validate(dataclasses.replace(cfg, data=bundled))
    if cfg.model.init_from is not None:  # the architecture is the directory's config.json
        return
    spec, args = startup.resolve_model(cfg)
    if world is not None:
        parallelisms.validate_parallel_config(cfg.parallel, world, args.num_experts, heads=spec.cp_head_counts(args),
                                              seq_len=cfg.data.seq_len)


def _bench_cells(command: Command) -> list[tuple[list[str], int]]:
    """The train.py overrides and world size of each grid cell of a scripts/bench.py command, as bench.py builds
    them."""
    spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    try:
        args = bench.parse_args(list(command.args))
    except SystemExit as e:
        raise ValueError(f"scripts/bench.py refuses its arguments {' '.join(command.args)}") from e
    out, tokens = Path("/nonexistent/bench"), Path("/nonexistent/bench/random_tokens.npy")
    return [(bench.cell_overrides(args, layout, dispatcher, out, tokens), args.nproc)
            for layout in args.layouts.split(",") for dispatcher in args.dispatchers.split(",")]


def check_command(command: Command) -> list[str]:
    """The errors of one command: ``file:line: override: why``, empty when it composes and validates."""
    errors = []
    plan_overrides = [o.removeprefix("plan.") for o in command.overrides if o.startswith("plan.")]
    if plan_overrides:
        if command.entry != "scripts/plan.py":
            errors.append(f"{command.where}: plan.* keys are scripts/plan.py's, not {command.entry}'s")
        try:
            OmegaConf.merge(OmegaConf.structured(PlanConfig), OmegaConf.from_dotlist(plan_overrides))
        except Exception as e:  # noqa: BLE001 - the message is the report
            errors.append(f"{command.where}: plan.{' plan.'.join(plan_overrides)}: {type(e).__name__}: {e}")
    try:
        runs = (_bench_cells(command) if command.entry == "scripts/bench.py"
                else [([o for o in command.overrides if not o.startswith("plan.")], _world_size(command))])
    except ValueError as e:
        return [*errors, f"{command.where}: {e}"]
    for overrides, world in runs:
        errors += _check_overrides(command, overrides, world)
    return errors


def _world_size(command: Command) -> int | None:
    """The processes the command starts, where it says: torchrun's --nnodes x --nproc_per_node, train.py's
    launch.nproc_per_node (1 when unset), scripts/plan.py's plan.gpus (not under plan.sweep); None where the machine
    decides (Slurm)."""
    def flag(words: tuple[str, ...], name: str) -> str | None:
        for i, word in enumerate(words):
            if word == name and i + 1 < len(words):
                return words[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
        return None

    values = dict(o.split("=", 1) for o in command.overrides)
    if command.launcher[:1] == ("torchrun",):
        sizes = [flag(command.launcher, "--nproc_per_node"), flag(command.launcher, "--nnodes") or "1"]
        return int(sizes[0]) * int(sizes[1]) if all(s and s.isdigit() for s in sizes) else None
    if command.entry == "train.py":
        value = values.get("launch.nproc_per_node", "1")
        return int(value) if value.isdigit() else None
    if command.entry == "scripts/plan.py" and values.get("plan.gpus", "").isdigit() and \
            values.get("plan.sweep", "false") == "false":  # a sweep tries layouts of its own
        return int(values["plan.gpus"])
    return None


def _check_overrides(command: Command, overrides: list[str], world: int | None) -> list[str]:
    errors = []
    concrete = [o for o in overrides if not _is_placeholder(o.split("=", 1)[1])]
    placeholders = [o.split("=", 1)[0] for o in overrides if _is_placeholder(o.split("=", 1)[1])]
    # Without a placeholder's value the config may lack what validation asks for (data.path=$DATA): compose only.
    for job in expand_sweeps(concrete, command.multirun):
        try:
            node = compose(config_name="config", overrides=job)
            for key in placeholders:
                if OmegaConf.select(node, key.lstrip("+~"), default=_ABSENT) is _ABSENT:
                    raise KeyError(f"{key} is not a config key (its value is a placeholder)")
            cfg = to_train_config(node)
            if not placeholders:
                _validate(cfg, world)
        except Exception as e:  # noqa: BLE001 - the message is the report
            errors.append(f"{command.where}: {' '.join(job)}: {type(e).__name__}: {str(e).splitlines()[0]}")
    return errors


ALL_COMMANDS = [c for doc in DOC_FILES for c in commands(doc)]


@pytest.fixture(scope="module")
def hydra_conf() -> Iterator[None]:
    """One Hydra initialisation for the module (compose is then ~50 ms)."""
    register_schema()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        yield


def test_the_docs_hold_enough_commands_to_be_worth_checking() -> None:
    by_entry = {e: sum(c.entry == e for c in ALL_COMMANDS) for e in PYTHON_ENTRIES}
    assert by_entry["train.py"] >= 30 and by_entry["scripts/plan.py"] >= 2, by_entry
    assert sum(len(c.overrides) for c in ALL_COMMANDS) >= 150
    assert any(c.multirun for c in ALL_COMMANDS) and any(c.entry.endswith(".sbatch") for c in ALL_COMMANDS)


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=lambda c: c.where)
def test_every_documented_override_composes(command: Command, hydra_conf) -> None:
    errors = check_command(command)
    assert not errors, "\n".join(errors)


def test_a_bad_override_is_reported_with_file_and_line(tmp_path: Path, hydra_conf) -> None:
    doc = tmp_path / "bad.md"
    doc.write_text("intro\n\n```bash\npython train.py train.steps=3  # fine\n"
                   "torchrun --nproc_per_node 2 train.py train.stepz=3 \\\n    parallel=ep2\n"
                   "python train.py parallel=ep3\n"
                   "python train.py -m dispatcher=eager,nope\n"
                   "python train.py optim.lr=-1\n"
                   "python scripts/plan.py model=qwen3_moe_30b_a3b plan.gpuz=8\n"
                   "python train.py train.steps=<N> train.stepz=<N>\n"
                   "torchrun --nproc_per_node 2 train.py parallel=ep4 && python train.py model.arch.num_hidden_layerz=2\n"
                   "```\n\n```python\ntrain.py train.stepz=1  # not a shell block\n```\n")
    found = list(commands(doc, doc.read_text()))
    assert [c.line for c in found] == [4, 5, 7, 8, 9, 10, 11, 12, 12]
    errors = {c.line: check_command(c) for c in found}
    assert errors[4] == []
    assert len(errors[5]) == 1 and "bad.md:5" in errors[5][0] and "train.stepz" in errors[5][0]
    assert "bad.md:7" in errors[7][0] and "ep3" in errors[7][0]
    assert len(errors[8]) == 1 and "dispatcher=nope" in errors[8][0]  # the sweep's eager job composes
    assert "optim.lr" in errors[9][0]  # validation, not only composition
    assert "bad.md:10" in errors[10][0] and "gpuz" in errors[10][0]
    assert len(errors[11]) == 1 and "train.stepz" in errors[11][0]  # a placeholder value: the key is still checked
    layout, arch = (check_command(c) for c in found[-2:])
    assert "bad.md:12" in layout[0] and "parallel.ep_size=4" in layout[0]  # 2 processes cannot hold ep 4
    assert "num_hidden_layerz" in arch[0]  # model.arch is free-form in the schema: the family's args check it


# --------------------------------------------------------------------------------------------------- links

def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    outside = _outside_fences(text)
    seen: dict[str, int] = {}
    out = set()
    for line in outside:
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = _slug(heading.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def _outside_fences(text: str) -> list[str]:
    """The lines outside fenced code blocks (blanks in their place, so line numbers hold)."""
    lines, inside = [], False
    for line in text.split("\n"):
        if re.match(r"\s*(```|~~~)", line):
            inside = not inside
            lines.append("")
        else:
            lines.append("" if inside else line)
    return lines


def broken_links(doc: Path, text: str | None = None) -> list[str]:
    """``file:line: target: why`` for every relative link (or image) that does not resolve."""
    text = doc.read_text() if text is None else text
    errors = []
    for number, line in enumerate(_outside_fences(text), 1):
        line = re.sub(r"`[^`]*`", "", line)  # links inside inline code are not links
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.is_relative_to(REPO) and doc.resolve().is_relative_to(REPO):
                errors.append(f"{_shown(doc)}:{number}: {target}: outside the repository, which a clone does not have")
            elif not file.exists():
                errors.append(f"{_shown(doc)}:{number}: {target}: no such file {file}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                errors.append(f"{_shown(doc)}:{number}: {target}: {file.name} has no heading #{anchor}")
    return errors


def test_every_relative_link_resolves() -> None:
    errors = [e for doc in DOC_FILES for e in broken_links(doc)]
    assert not errors, "\n".join(errors)


def test_a_broken_link_is_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title\n\n## Choosing a layout: `parallel=ep8`\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](other.md) [ok](other.md#choosing-a-layout-parallelep8) [ok](#here) [web](https://x.org/y)\n"
                   "# Here\n[gone](missing.md)\n[bad](other.md#nowhere)\n`[code](missing.md)`\n"
                   "```\n[in a block](missing.md)\n```\n")
    errors = broken_links(doc)
    assert len(errors) == 2, errors
    assert "doc.md:3: missing.md" in errors[0] and "doc.md:4: other.md#nowhere" in errors[1]


# --------------------------------------------------------------------------------------------------- paths

# Every file whose comments, docstrings or messages may cite a doc: the project's Python files, but this one, which
# spells out dead paths and lab-log citations to check that they are caught.
SOURCE_FILES = sorted(f for f in [REPO / "train.py", *(f for folder in ("core", "kernels", "models", "parallelisms",
                                                                         "training", "scripts", "tests")
                                                       for f in (REPO / folder).rglob("*.py"))]
                      if f != Path(__file__).resolve())
# ``docs/<path>`` (from the repository root) and its ``#anchor``; the path ends in a word character, so a sentence's
# full stop or a glob (``docs/*.md``) is not part of it.
_DOCS_PATH = re.compile(r"(?<![\w/.-])(docs/[\w./-]*\w)(?:#([\w-]+))?")
# A folder outside the clone that an earlier layout of the project kept its design notes and device scripts in.
_OUTSIDE = re.compile(r"\.\./shared/")


def unresolved_paths(file: Path, text: str | None = None) -> list[str]:
    """``file:line: path: why`` for every ``docs/...`` path ``file`` cites that does not exist (or whose ``#anchor``
    names no heading of it), and every citation of ``../shared/``, which a clone does not have."""
    text = file.read_text() if text is None else text
    errors = []
    for number, line in enumerate(text.split("\n"), 1):
        for match in _DOCS_PATH.finditer(line):
            path, anchor = REPO / match.group(1), match.group(2)
            if not path.exists():
                errors.append(f"{_shown(file)}:{number}: {match.group(0)}: no such file or folder")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
                errors.append(f"{_shown(file)}:{number}: {match.group(0)}: {path.name} has no heading #{anchor}")
        if _OUTSIDE.search(line):
            errors.append(f"{_shown(file)}:{number}: cites ../shared/, outside the repository: put what it needs in "
                          "the repository (docs/design.md) and cite that")
    return errors


def test_every_cited_docs_path_resolves() -> None:
    errors = [e for f in [*DOC_FILES, *SOURCE_FILES] for e in unresolved_paths(f)]
    assert not errors, "\n".join(errors)


# The lab log: dated rounds as they were written, whose figures may be superseded. Code cites docs/results.md.
_LAB_LOG = re.compile(r"docs/lab\b|benchmarks\.md|\blab log\b")


def code_citing_the_lab_log(files: list[Path]) -> list[str]:
    return [f"{_shown(f)}:{number}: {line.strip()}" for f in files
            for number, line in enumerate(f.read_text().split("\n"), 1) if _LAB_LOG.search(line)]


def test_code_cites_the_results_page_not_the_lab_log() -> None:
    found = code_citing_the_lab_log(SOURCE_FILES)
    assert not found, ("these cite the lab log; cite the docs/results.md row instead (docs/results.md#<section>, and "
                       "the row), adding the row if it is missing:\n" + "\n".join(found))


def test_a_dead_path_and_a_lab_log_citation_are_reported(tmp_path: Path) -> None:
    source = tmp_path / "x.py"
    source.write_text("# measured: docs/results.md#compile.\n# docs/nowhere.md, docs/results.md#nowhere\n"
                      "# docs/*.md, ../docs/x.md\n# see ../shared/design/notes.md\n"
                      "# the docs/lab/benchmarks.md round\n")
    errors = unresolved_paths(source)
    assert len(errors) == 3, errors
    assert "x.py:2: docs/nowhere.md: no such file" in errors[0] and "has no heading #nowhere" in errors[1]
    assert "x.py:4: cites ../shared/" in errors[2]
    assert code_citing_the_lab_log([source]) == ["x.py:5: # the docs/lab/benchmarks.md round"]


# --------------------------------------------------------------------------------------------------- pages

def unlinked_pages(readme: str, developers: str, pages: list[Path]) -> list[str]:
    """The pages of docs/ that neither README.md nor DEVELOPERS.md links (a page no one can find from the top)."""
    linked = set(re.findall(r"\]\((docs/[^)#\s]+)", readme + developers))
    return [str(page.relative_to(REPO)) for page in pages if str(page.relative_to(REPO)) not in linked]


def test_every_doc_page_is_linked_from_the_readme_or_developers() -> None:
    pages = sorted((REPO / "docs").rglob("*.md"))
    readme, developers = (REPO / "README.md").read_text(), (REPO / "DEVELOPERS.md").read_text()
    assert len(pages) >= 15
    orphans = unlinked_pages(readme, developers, pages)
    assert not orphans, f"pages linked from neither README.md nor DEVELOPERS.md: {orphans}"
    assert unlinked_pages(readme.replace("](docs/design.md)", "]()"), developers.replace("](docs/design.md)", "]()"),
                          pages) == ["docs/design.md"]


def raw_section(text: str, heading: str) -> str:
    """The lines after ``heading`` up to the next heading of its level or above, fenced blocks included."""
    level = len(heading) - len(heading.lstrip("#"))
    body = text.split(heading + "\n", 1)[1]
    end = re.search(rf"^#{{1,{level}}}\s", body, re.M)
    return body[:end.start()] if end else body


README_LAYOUT = "## Repository layout"


def scripts_missing_from(layout: str, root: Path) -> list[str]:
    """Every scripts/*.py and scripts/slurm/* file that the README's repository layout does not name."""
    scripts = [*sorted((root / "scripts").glob("*.py")), *sorted(p for p in (root / "scripts" / "slurm").iterdir()
                                                              if p.is_file())]
    return [str(p.relative_to(root)) for p in scripts if not re.search(rf"(?<![\w.-]){re.escape(p.name)}\b", layout)]


def test_every_script_is_in_the_readme_layout() -> None:
    layout = raw_section((REPO / "README.md").read_text(), README_LAYOUT)
    missing = scripts_missing_from(layout, REPO)
    assert not missing, f"README.md, '{README_LAYOUT}' does not list {missing}: add a line for each"
    assert scripts_missing_from(layout.replace("plot_routing.py", "plot.py"), REPO) == ["scripts/plot_routing.py"]
    assert "scripts/slurm/launch.sh" in scripts_missing_from(layout.replace("launch.sh", "start.sh"), REPO)


# --------------------------------------------------------------------------------------------------- keys

def test_every_config_key_is_in_the_configuration_page(hydra_conf) -> None:
    """docs/configuration.md names every key of the schema (``model.arch.*`` is the family's: models/*/args.py)."""
    page = (REPO / "docs" / "configuration.md").read_text()

    def leaves(node, prefix: str) -> Iterator[str]:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if path in ("hydra", "model.arch"):
                continue
            yield from leaves(value, path + ".") if isinstance(value, dict) else [path]

    tree = OmegaConf.to_container(compose(config_name="config"), resolve=False)
    missing = [k for k in leaves(tree, "") if f"`{k}`" not in page and not k.endswith(".name")]
    assert not missing, f"docs/configuration.md does not document {missing}"


# --------------------------------------------------------------------------------------------------- figures

RESULTS = REPO / "docs" / "results.md"
# The README's sections that quote measurements; each must link docs/results.md and name its card.
README_RESULTS_SECTIONS = ("Why: the numbers", "One GPU: what is fast and what fits")
# A figure: a number with a thousands separator or a decimal point (116,921, 52.9, 1.00x, 2.11.0), or a date.
# Plain integers are left out: in prose they are settings (4 layers, seq 4096, top-8), not measurements.
_FIGURE = re.compile(r"\d{4}-\d{2}-\d{2}|\d+(?:[.,]\d+)+")


def figures(text: str) -> set[str]:
    """The figures of ``text`` outside fenced blocks, each whole (116,921 is not 16,921)."""
    return set(_FIGURE.findall("\n".join(_outside_fences(text))))


def sections(text: str, titles: tuple[str, ...]) -> dict[str, str]:
    """The body of each heading titled ``titles`` (up to the next heading of any level), where it exists."""
    found, title = {}, None
    for line in _outside_fences(text):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            title = heading.group(1) if heading.group(1) in titles else None
            if title is not None:
                found[title] = ""
        elif title is not None:
            found[title] += line + "\n"
    return found


def unquoted_figures(readme: str, results: str) -> list[str]:
    """``README.md, <section>: why`` for every figure of the README's results sections that docs/results.md does not
    hold, every such section missing, and every one that does not link docs/results.md or name its card."""
    known, errors = figures(results), []
    found = sections(readme, README_RESULTS_SECTIONS)
    for title in README_RESULTS_SECTIONS:
        if title not in found:
            errors.append(f"README.md has no section '{title}' (tests/test_docs.py: README_RESULTS_SECTIONS)")
            continue
        body = found[title]
        if "](docs/results.md" not in body:
            errors.append(f"README.md, '{title}': does not link docs/results.md, where its figures come from")
        if not re.search(r"\bH[12]00\b", body):
            errors.append(f"README.md, '{title}': names no card (H100, H200)")
        errors += [f"README.md, '{title}': {figure} is not in docs/results.md (add its row there, or quote a figure "
                   f"that is)" for figure in sorted(figures(body) - known)]
    return errors


# A measurement with a thousands separator (tokens/s). Those that are settings, not measurements, are exempt: powers
# of two (sequence lengths, 4,096) and the figures of docs/results.md's introduction (the vocabularies).
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+")
_ANCHOR_SYSTEMS = re.compile(r"torchtitan|transformers", re.I)


def _table_rows(text: str) -> list[str]:
    return [line for line in _outside_fences(text) if line.startswith("|") and not re.fullmatch(r"[|\s:-]+", line)]


def current_and_anchor_figures(results: str) -> tuple[list[set[str]], set[str], set[str]]:
    """Of docs/results.md: per table row, its current figures (those in bold on their own: ``**113,400**``); all of
    them; and the anchors' (the figures of a clause, between ``.``/``;`` and the next, that names torchtitan or
    transformers)."""
    current = [set(re.findall(r"\*\*(\d{1,3}(?:,\d{3})+)\*\*", row)) for row in _table_rows(results)]
    anchors_ = {figure for row in _table_rows(results) for cell in row.split("|")
                for clause in re.split(r"[.;]\s+", cell) if _ANCHOR_SYSTEMS.search(clause)
                for figure in _THOUSANDS.findall(clause)}
    return current, set().union(*current), anchors_


def superseded_figures(readme: str, results: str) -> list[str]:
    """``README.md, <section>: why`` for every measurement of the README's results sections that is neither a
    workload's current figure in docs/results.md nor an anchor's (an older run, another draw, a same-call baseline:
    a second figure for a workload the README already quotes), and every results.md row two of whose current
    figures the README quotes."""
    current_by_row, current, anchor_figures = current_and_anchor_figures(results)
    intro = results.split("\n## ", 1)[0]
    settings = set(_THOUSANDS.findall(intro))
    errors = []
    for title, body in sections(readme, README_RESULTS_SECTIONS).items():
        quoted = {f for f in figures(body) if _THOUSANDS.fullmatch(f)}
        for figure in sorted(quoted - current - anchor_figures - settings):
            value = int(figure.replace(",", ""))
            if value & (value - 1):  # not a power of two
                errors.append(f"README.md, '{title}': {figure} is not a current figure of docs/results.md (one in "
                              f"bold) nor an anchor's: quote the current figure of its workload, once")
        errors += [f"README.md, '{title}': {' and '.join(sorted(row & quoted))} are one row of docs/results.md: "
                   f"quote one figure per workload" for row in current_by_row if len(row & quoted) > 1]
    return errors


def test_the_readme_quotes_each_workload_once_with_its_current_figure() -> None:
    readme, results = (REPO / "README.md").read_text(), RESULTS.read_text()
    errors = superseded_figures(readme, results)
    assert not errors, "\n".join(errors)
    current_by_row, current, anchor_figures = current_and_anchor_figures(results)
    assert len(current) >= 40 and {"61,900", "19,355", "42,300", "67,120"} <= anchor_figures - current


def test_a_second_figure_for_a_workload_is_reported() -> None:
    readme, results = (REPO / "README.md").read_text(), RESULTS.read_text()
    one_gpu = "One GPU: what is fast and what fits"
    # the 4-layer step of 2026-11-30 beside today's: an older run of the same workload
    older = readme.replace("| 113,400 (52.9) |", "| 113,400 (52.9; 86,748 on 2026-11-30) |")
    assert superseded_figures(older, results) == [
        f"README.md, '{one_gpu}': 86,748 is not a current figure of docs/results.md (one in bold) nor an anchor's: "
        "quote the current figure of its workload, once"]
    # a draw measured beside the row (fp32 moments in the bf16-moments call) and the eager step of the compile call
    assert superseded_figures(readme.replace("(AdamW moments in bf16)", "(116,921 with fp32 moments)"), results)
    assert superseded_figures(readme.replace("8 layers, 4 x 4,096", "8 layers (eager 4 layers: 102,034)"), results)
    # two current figures of one row: Qwen3.5's eager and fused at ep2
    assert superseded_figures(readme.replace("18,463 tokens/s/GPU here", "18,463 / 18,406 tokens/s/GPU here"),
                              results.replace("**18,463** / 18,406", "**18,463** / **18,406**"))[-1].endswith(
        "18,406 and 18,463 are one row of docs/results.md: quote one figure per workload")


def test_the_readme_quotes_only_figures_of_the_results_page() -> None:
    readme = (REPO / "README.md").read_text()
    assert not unquoted_figures(readme, RESULTS.read_text()), "\n".join(unquoted_figures(readme, RESULTS.read_text()))
    quoted = {title: figures(body) for title, body in sections(readme, README_RESULTS_SECTIONS).items()}
    assert all(len(f) >= 10 for f in quoted.values()), quoted  # the check has figures to bite on


def test_a_readme_figure_edited_alone_is_reported() -> None:
    readme, results = (REPO / "README.md").read_text(), RESULTS.read_text()
    figure = "70,501"  # the one-GPU 8-layer row, quoted once
    assert readme.count(figure) == 1
    assert figure in sections(readme, README_RESULTS_SECTIONS)["One GPU: what is fast and what fits"]
    edited = readme.replace(figure, "70,502")
    assert unquoted_figures(edited, results) == [
        "README.md, 'One GPU: what is fast and what fits': 70,502 is not in docs/results.md (add its row there, "
        "or quote a figure that is)"]
    assert unquoted_figures(readme.replace("52.9", "52.8"), results)  # a peak GiB
    assert unquoted_figures(readme.replace("2026-12-06", "2099-01-01"), results)  # a date results.md never names
    # A figure only in a longer one of the page does not count: 70,501 is not 170,501.
    assert unquoted_figures(readme, results.replace("70,501", "170,501"))
    assert any("no section 'Why: the numbers'" in e
               for e in unquoted_figures(readme.replace("## Why: the numbers", "## Why"), results))
    assert any("names no card" in e for e in unquoted_figures(re.sub(r"\bH[12]00\b", "GPU", readme), results))

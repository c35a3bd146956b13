"""The docs keep their promises: what README.md and docs/ link to, and the commands they show, exist.

- every relative link (and image) resolves to a file or folder, and a `#anchor` to a heading of the target
  (GitHub's slugs);
- every `make TARGET`, `manage.py COMMAND` and `python -m MODULE` in code names a Makefile target, a management
  command and a module of this repository (or of the standard library);
- docs/operations.md names every environment variable platform/observatory/settings.py reads.

Dated notes (docs/notes/) are history, kept as written: their links are checked, not the commands they ran.
"""
from __future__ import annotations

import re
import shlex
import sys
import urllib.parse
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.mode_independent  # no database, no broker: CI runs it once (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOTES = ROOT / "docs" / "notes"

# Django's and django-axes' own commands the docs use; each is checked to exist in the installed package below.
BUILTIN_COMMANDS = {
    "migrate": "django/core/management/commands/migrate.py",
    "shell": "django/core/management/commands/shell.py",
    "createsuperuser": "django/contrib/auth/management/commands/createsuperuser.py",
    "changepassword": "django/contrib/auth/management/commands/changepassword.py",
    "collectstatic": "django/contrib/staticfiles/management/commands/collectstatic.py",
    "axes_reset": "axes/management/commands/axes_reset.py",
    "axes_reset_ip": "axes/management/commands/axes_reset_ip.py",
    "axes_reset_username": "axes/management/commands/axes_reset_username.py",
}
# Modules outside the repository and the standard library that docs run with `python -m`.
EXTERNAL_MODULES = {"pytest", "pip"}

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
MANAGE = re.compile(r"manage\.py\s+([a-z_][a-z0-9_]*)")
PYTHON_M = re.compile(r"python[0-9.]*\s+-m\s+([A-Za-z_][\w.]*)")
COMMENT = re.compile(r"(^|\s)#(\s.*)?$")  # a shell, YAML or Python comment: prose, not a command
SETTING = re.compile(r"\b(?:env(?:int|bool|float|choice)?|os\.environ\.get)\(\s*\"([A-Z][A-Z0-9_]*)\"")


def split_markdown(path: Path) -> tuple[str, list[str]]:
    """(the prose, with fenced code blanked out; the lines of the fenced code blocks)."""
    prose, code, fence = [], [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            prose.append("")
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            else:
                code.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), code


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text).lower()
    return "".join(ch for ch in text if ch.isalnum() or ch in "-_ ").replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    prose, _ = split_markdown(path)
    seen: dict[str, int] = {}
    result = set()
    for line in prose.splitlines():
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return frozenset(result)


def links(path: Path) -> list[str]:
    prose, _ = split_markdown(path)
    prose = INLINE_CODE.sub("", prose)
    return LINK.findall(prose)


def shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def broken_links(path: Path) -> list[str]:
    problems = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / urllib.parse.unquote(file_part)).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"{shown(path)}: ({target}): no such file {shown(resolved)}")
        elif anchor and resolved.suffix == ".md" and urllib.parse.unquote(anchor) not in anchors(resolved):
            problems.append(f"{shown(path)}: ({target}): no heading #{anchor} in {shown(resolved)}")
    return problems


def code_texts(path: Path) -> list[str]:
    """The docs' code: every line of the fenced blocks (less its comment) and every inline code span."""
    prose, code = split_markdown(path)
    return [COMMENT.sub("", line) for line in code] + [match.group(2) for match in INLINE_CODE.finditer(prose)]


def make_targets_named(text: str) -> list[str]:
    targets = []
    for segment in re.split(r"&&|\|\||;|\||\$?\(", text):
        try:
            words = shlex.split(segment, comments=True)
        except ValueError:
            words = segment.split()
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value make …
            words.pop(0)
        if not words or words[0] != "make":
            continue
        targets += [w for w in words[1:] if "=" not in w and not w.startswith("-") and re.fullmatch(r"[\w.-]+", w)]
    return targets


@cache
def makefile_targets() -> frozenset[str]:
    names = set()
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+(?:[ \t]+[A-Za-z0-9_.-]+)*)[ \t]*:(?!=)", line)
        if match:
            names.update(n for n in match.group(1).split() if not n.startswith("."))
    return frozenset(names)


@cache
def management_commands() -> frozenset[str]:
    files = [*ROOT.glob("platform/*/management/commands/*.py"), *ROOT.glob("dashboards/management/commands/*.py")]
    return frozenset(f.stem for f in files if not f.stem.startswith("_")) | frozenset(BUILTIN_COMMANDS)


def module_exists(name: str) -> bool:
    if name.split(".")[0] in sys.stdlib_module_names or name in EXTERNAL_MODULES:
        return True
    for source_root in (ROOT / "platform", ROOT):
        path = source_root.joinpath(*name.split("."))
        if path.with_suffix(".py").is_file() or (path / "__main__.py").is_file():
            return True
    return False


def checked_for_commands(path: Path) -> bool:
    return not path.is_relative_to(NOTES)


def test_the_docs_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/ingest.md", "docs/operations.md"} <= names, sorted(names)


def test_every_relative_link_resolves_to_a_file_and_its_anchor_to_a_heading():
    problems = [problem for path in DOCS for problem in broken_links(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_make_target_in_the_docs_is_in_the_makefile():
    problems = [f"{path.relative_to(ROOT)}: make {target}"
                for path in DOCS if checked_for_commands(path)
                for text in code_texts(path) for target in make_targets_named(text)
                if target not in makefile_targets()]
    assert not problems, "targets the Makefile does not have:\n" + "\n".join(problems)


def test_every_manage_py_command_in_the_docs_exists():
    problems = [f"{path.relative_to(ROOT)}: manage.py {command}"
                for path in DOCS if checked_for_commands(path)
                for text in code_texts(path) for command in MANAGE.findall(text)
                if command not in management_commands()]
    assert not problems, "no such management command:\n" + "\n".join(problems)


def test_the_builtin_commands_the_docs_may_name_are_installed():
    import importlib.util

    missing = []
    for command, relative in BUILTIN_COMMANDS.items():
        package = relative.split("/")[0]
        spec = importlib.util.find_spec(package)
        base = Path(next(iter(spec.submodule_search_locations))).parent if spec else None
        if base is None or not (base / relative).is_file():
            missing.append(f"{command} ({relative})")
    assert not missing, missing


def test_every_python_m_module_in_the_docs_exists():
    problems = [f"{path.relative_to(ROOT)}: python -m {module}"
                for path in DOCS if checked_for_commands(path)
                for text in code_texts(path) for module in PYTHON_M.findall(text)
                if not module_exists(module.rstrip("."))]
    assert not problems, "no such module in the repository:\n" + "\n".join(problems)


def test_operations_md_names_every_setting():
    settings = set(SETTING.findall((ROOT / "platform/observatory/settings.py").read_text(encoding="utf-8")))
    assert len(settings) > 50, sorted(settings)  # the pattern still finds them
    text = (ROOT / "docs/operations.md").read_text(encoding="utf-8")
    missing = sorted(name for name in settings if not re.search(rf"\b{name}\b", text))
    assert not missing, f"docs/operations.md does not name these settings: {missing}"


@pytest.mark.parametrize("heading, anchor", [
    ("Settings (`NOTIFY` in `observatory/settings.py`, from the environment)",
     "settings-notify-in-observatorysettingspy-from-the-environment"),
    ("`GET /api/v1/requests?trace_id=HEX`", "get-apiv1requeststrace_idhex"),
    ("What is counted (the SLI)", "what-is-counted-the-sli"),
    ("Decoding: the C fast path", "decoding-the-c-fast-path"),
    ("Real vLLM on CPU", "real-vllm-on-cpu"),
])
def test_slugs_are_githubs(heading, anchor):
    assert slug(heading) == anchor


def test_code_is_not_a_link_and_a_broken_link_or_anchor_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n`[a](missing.md)`\n\n```\n[b](missing.md)\n```\n\n[c](#title) [d](page.md#title)\n")
    assert links(page) == ["#title", "page.md#title"]
    assert broken_links(page) == []
    page.write_text("# Title\n\n[gone](missing.md) [no heading](#nowhere) ![image](\nmissing.png)\n")
    assert len(broken_links(page)) == 3, broken_links(page)


def test_make_targets_are_read_as_make_reads_them():
    assert make_targets_named("make up ENGINE=vllm   # real vLLM") == ["up"]
    assert make_targets_named('LOAD=0 make up') == ["up"]
    assert make_targets_named('make test PYTEST_ARGS="-k decomposition -x"') == ["test"]
    assert make_targets_named("cd x && make lint docker-check") == ["lint", "docker-check"]
    assert make_targets_named("the make of it") == []

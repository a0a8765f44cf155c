"""The docs point at things that exist: every relative link in README.md and docs/**/*.md
resolves to a file (and its #anchor to a heading of that file), every backticked repo path
(`condattn_jax/...`, `configs/...`, `tests/...`, ...) exists, and every cited test
(`tests/<file>.py::test_name`, or `::test_name` after a file on the same line) is defined there.
Pure text checks: no jax import, well under a second."""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
PATH_ROOTS = ("condattn_jax/", "configs/", "tests/", "bench/", "scripts/", "pallas_kernels/",
              "docs/")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")


def anchors(md: pathlib.Path) -> set[str]:
  """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces -> '-'."""
  out = set()
  in_fence = False
  for line in md.read_text().splitlines():
    if line.startswith("```"):
      in_fence = not in_fence
    m = None if in_fence else re.match(r"#{1,6}\s+(.*)", line)
    if m:
      out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
  return out


def prose(md: pathlib.Path):
  """(line number, line) outside fenced code blocks."""
  in_fence = False
  for i, line in enumerate(md.read_text().splitlines(), 1):
    if line.startswith("```"):
      in_fence = not in_fence
      continue
    if not in_fence:
      yield i, line


def rel(md: pathlib.Path) -> str:
  return str(md.relative_to(ROOT))


@pytest.mark.parametrize("md", PAGES, ids=rel)
def test_relative_links_resolve(md):
  bad = []
  for i, line in prose(md):
    for target in LINK.findall(line):
      if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
        continue
      path, _, anchor = target.partition("#")
      dest = (md.parent / path).resolve() if path else md
      if not dest.exists():
        bad.append(f"{rel(md)}:{i}: link {target!r}: no file {path!r}")
      elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        bad.append(f"{rel(md)}:{i}: link {target!r}: no heading with anchor #{anchor} in "
                   f"{dest.relative_to(ROOT)}")
  assert not bad, "\n".join(bad)


@pytest.mark.parametrize("md", PAGES, ids=rel)
def test_backticked_paths_and_tests_exist(md):
  bad = []
  for i, line in prose(md):
    last_file = None
    for code in CODE.findall(line):
      token = code.split()[0] if code.split() else ""
      if token.startswith("::") and last_file is not None:
        path, name = last_file, token[2:]
      elif token.startswith(PATH_ROOTS):
        path, _, name = token.partition("::")
      else:
        continue
      path = path.split(":")[0] if not name else path  # `configs/x.py:variant` names a file
      if any(c in path for c in "*<>{}$"):  # a pattern, not a path
        continue
      f = ROOT / path
      if not f.exists():
        bad.append(f"{rel(md)}:{i}: `{code}`: no such path {path!r}")
        continue
      if f.is_file() and f.suffix == ".py":
        last_file = path
      name = re.sub(r"\[.*", "", name)
      if name and not re.search(rf"^\s*def {re.escape(name)}\(", f.read_text(), re.M):
        bad.append(f"{rel(md)}:{i}: `{code}`: {path} defines no {name}")
  assert not bad, "\n".join(bad)


SCHEME_PAGES = ("l2a", "aha", "elastic", "segmented", "match")


def documented_options(md: pathlib.Path) -> list[str]:
  """The backticked names in the first column of the page's '## Options' table."""
  names, in_section = [], False
  for _, line in prose(md):
    if line.startswith("## "):
      in_section = line.strip() == "## Options"
    elif in_section and line.startswith("|") and not line.startswith("|---"):
      names += CODE.findall(line.split("|")[1])
  return [n for n in names if n != "field"]


@pytest.mark.parametrize("scheme", SCHEME_PAGES)
def test_options_table_lists_every_option(scheme):
  import dataclasses
  from condattn_jax import attention
  fields = [f.name for f in dataclasses.fields(attention.get_scheme(scheme).options)]
  documented = documented_options(ROOT / "docs" / "schemes" / f"{scheme}.md")
  missing = [f for f in fields if f not in documented]
  unknown = [d for d in documented if d not in fields]
  assert not missing and not unknown, (
      f"docs/schemes/{scheme}.md '## Options' table: add {missing}, remove {unknown} "
      f"(the fields of condattn_jax/attention/{scheme}/options.py).")

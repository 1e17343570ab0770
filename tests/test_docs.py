"""The documentation: every relative link and anchor of the README and docs/ resolves; the
configuration reference is the schema's (generated, every key with a meaning); ``--explain``
prints one key's entry and names the closest ones for a key that does not exist."""

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set:
    anchors, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def broken_links(files, root: Path = REPO) -> list:
    """'file: link (why)' for every relative link whose file or anchor does not exist."""
    broken = []
    for path in files:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for match in LINK.finditer(text):
            target = match.group(1) or match.group(2)
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                broken.append(f"{path.relative_to(root)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{path.relative_to(root)}: {target} (no such heading)")
    return broken


def test_every_relative_link_and_anchor_resolves(tmp_path):
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "examples").rglob("*.md"))]
    assert broken_links(files) == []
    (tmp_path / "a.md").write_text("# A `title`\n\n[ok](#a-title) [gone](#nothing) [file](b.md#b) [missing](c.md)\n")
    (tmp_path / "b.md").write_text("# B\n")
    assert broken_links([tmp_path / "a.md"], tmp_path) == ["a.md: #nothing (no such heading)",
                                                          "a.md: c.md (no such file)"]


def test_the_configuration_reference_is_the_schemas():
    from megatron_rlhf.config.reference import entries, markdown

    written = (REPO / "docs" / "config_reference.md").read_text()
    assert written == markdown(), "docs/config_reference.md differs from the schema: python -m " \
                                  "megatron_rlhf.config.reference > docs/config_reference.md"
    undocumented = [e.key for e in entries() if not e.meaning.strip()]
    assert undocumented == [], f"keys without a meaning beside their field in schema.py: {undocumented}"
    keys = {e.key for e in entries()}
    assert {"rollout.partial.chunk_tokens", "ppo.clip_ratio_c", "<role>.lr", "reward.function", "dpo.beta",
            "rollout.sandbox.kind"} <= keys


def test_explain_prints_one_key_and_names_the_closest_for_a_typo():
    run = lambda key: subprocess.run([sys.executable, "-m", "megatron_rlhf.train", "--explain", key],  # noqa: E731
                                     capture_output=True, text=True, cwd=REPO, timeout=120)
    shown = run("ppo.clip_ratio_c")
    assert shown.returncode == 0 and shown.stdout.startswith("ppo.clip_ratio_c: Dual-clip PPO")
    assert "  type: float or null\n  default: null\n  allowed: > 1\n  read by: rl" in shown.stdout
    role = run("reward.lr")
    assert role.returncode == 0 and "read by: rm, where reward is trained (refused where it is not)" in role.stdout
    typo = run("ppo.clip_ratio_cc")
    assert typo.returncode == 2 and typo.stderr.count("error:") == 1 and "did you mean ppo.clip_ratio_c" in typo.stderr


def test_every_key_the_trl_and_verl_page_names_here_exists():
    """The right-hand column of docs/guide/coming-from-trl-and-verl.md names our keys: each is one of
    the schema's (a role's as <role>.key), so a renamed key cannot leave the page behind."""
    import re

    from megatron_rlhf.config.reference import entries
    from megatron_rlhf.config.schema import ROLE_NAMES

    keys = {e.key for e in entries()}
    page = (REPO / "docs" / "guide" / "coming-from-trl-and-verl.md").read_text()
    named = set()
    for row in re.findall(r"^\|.*\| (.*) \|$", page, flags=re.M):
        named |= {k for k in re.findall(r"`([a-z_]+(?:\.[a-z_*]+)+)", row)}
    assert len(named) > 40, named

    def known(key: str) -> bool:
        key = key.removesuffix(".*")
        role, _, rest = key.partition(".")
        return key in keys or (role in ROLE_NAMES and f"<role>.{rest}" in keys)

    assert [key for key in sorted(named) if not known(key)] == []


def test_explain_reads_the_schema_alone_without_importing_torch():
    """`--explain` (and the planner's memory kinds) import no torch: a key's entry in a tenth of a second."""
    code = ("import sys\nfrom megatron_rlhf.train import main\nfrom megatron_rlhf.memory import kinds, planner\n"
            "try:\n    main(['--explain', 'ppo.kl_coef'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0 and "ppo.kl_coef:" in done.stdout, done.stderr

"""The documentation: every relative link and anchor of the README and docs/ resolves; the
configuration reference is the schema's (generated, every key with a meaning); ``--explain``
prints one key's entry and names the closest ones for a key that does not exist."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert role.returncode == 0 and "read by: rm, prm, where reward is trained (refused where it is not)" in role.stdout
    typo = run("ppo.clip_ratio_cc")
    assert typo.returncode == 2 and typo.stderr.count("error:") == 1 and "did you mean ppo.clip_ratio_c" in typo.stderr
    trl = run("num_generations")  # a peer's name: ours, and its entry
    assert trl.returncode == 0 and trl.stdout.startswith("num_generations is TRL's name; here: "
                                                         "generation.samples_per_prompt\ngeneration.samples_per_prompt: ")
    verl = run("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    assert verl.returncode == 0 and "verl's name; here: <role>.max_tokens_per_micro_batch\n" in verl.stdout


def test_every_peer_name_explain_knows_points_to_a_key_here():
    from megatron_rlhf.config.reference import PEERS_NAMES, entries
    from megatron_rlhf.config.schema import ROLE_NAMES

    keys = {e.key for e in entries()}
    as_listed = lambda key: f"<role>.{key.partition('.')[2]}" if key.partition(".")[0] in ROLE_NAMES else key  # noqa: E731
    missing = [ours for _, ours in PEERS_NAMES.values() if as_listed(ours) not in keys]
    assert not missing, missing


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


@pytest.mark.parametrize("command, said", [
    (["--explain", "ppo.kl_coef"], "ppo.kl_coef:"),
    (["--config", "examples/tiny/rlhf.yaml", "--dry-run", "--world-size", "2"], "dry run: nothing was launched"),
])
def test_explain_and_the_dry_run_read_the_config_alone_without_importing_torch(command, said):
    """`--explain` and `--dry-run` (and the planner's memory kinds) import no torch: a tenth of a second."""
    code = ("import sys\nfrom megatron_rlhf.train import main\nfrom megatron_rlhf.memory import kinds, planner\n"
            f"try:\n    main({command!r})\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0 and said in done.stdout, done.stderr


def test_the_dry_runs_process_groups_are_megatrons():
    """dry_run.rank_groups (computed without megatron, so that a dry run imports no torch) against
    megatron-core's RankGenerator: dense TP/CP/DP/PP groups and expert EP/EDP groups, several layouts."""
    from megatron.core.parallel_state import RankGenerator

    from megatron_rlhf.dry_run import rank_groups

    for tp, pp, dp, ep, cp in [(1, 1, 1, 1, 1), (2, 1, 2, 1, 1), (2, 2, 2, 1, 1), (1, 2, 4, 2, 1), (2, 3, 4, 4, 1),
                               (4, 2, 6, 3, 1), (1, 1, 8, 8, 1), (1, 1, 1, 1, 2), (2, 1, 2, 1, 2), (2, 2, 1, 1, 4),
                               (1, 2, 3, 1, 2)]:
        dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        expected = {kind: dense.get_ranks(kind) for kind in ("tp", "cp", "dp", "pp")}
        if ep > 1:
            experts = RankGenerator(tp=tp, ep=ep, dp=dp // ep, pp=pp, cp=1, order="tp-ep-dp-pp")
            expected.update(ep=experts.get_ranks("ep"), edp=experts.get_ranks("dp"))
        assert rank_groups(tp, pp, dp, ep, cp) == expected, (tp, pp, dp, ep, cp)


# -- The commands the docs show ------------------------------------------------------------------
# Every line of a bash block in the README and the guide, run as far as it can run here: a make
# target (make -n), a tool or the planner (each flag its parser takes), a stage or RL launch whose
# files are in the checkout (--check-only at its world size), the launcher (as written with the
# variables the block exported, up to the user's own files: only those may be missing), a Slurm
# script (it exists). The commands run from the repository's root ($PWD). A synopsis ([--flag]) has each flag checked.

DOCUMENTED = [REPO / "README.md"] + sorted((REPO / "docs" / "guide").glob("*.md"))


def documented_commands(paths=DOCUMENTED):
    """(page, the environment its block exported so far, the command line) of every bash block line."""
    import shlex

    for page in paths:
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", page.read_text(), flags=re.S):
            exported = {}
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                words = [w.replace("$PWD", str(REPO)) for w in words]  # the commands run from the root
                if words and words[0] == "export":
                    exported.update(w.split("=", 1) for w in words[1:])
                elif words:
                    yield page.relative_to(REPO), dict(exported), words


def _usage(main) -> str:
    """What ``main(["--help"])`` prints (a tool's or module's parser), run in this process."""
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.suppress(SystemExit):
        main(["--help"])
    return printed.getvalue()


def _flags_taken(words, usage: str) -> list:
    """The --flags of ``words`` that ``usage`` (a parser's help) does not name."""
    flags = [w.split("=")[0] for w in words if w.startswith("--")]
    return [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", usage)]


def _check_command(env: dict, words: list, tmp_path) -> str:
    """What is wrong with one documented command, or ''."""
    import os

    run = lambda argv, **more: subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120,  # noqa: E731
                                              env={**os.environ, **more})
    lead = next(i for i, w in enumerate(words) if not re.match(r"^[A-Za-z_]\w*=", w))  # VAR=value command ...
    assignments, words = dict(w.split("=", 1) for w in words[:lead]), words[lead:]
    program = words[0]
    if program == "make":
        made = run(["make", "-n", f"VENV={tmp_path}/venv", *words[1:]])
        return "" if made.returncode == 0 else made.stderr
    if program == "sbatch":
        return "" if (REPO / words[-1]).is_file() else f"{words[-1]}: no such file"
    if program == "bash":
        launched = run(["bash", *words[1:]], **{"PYTHON": sys.executable, **env, **assignments,
                                                 "CHECK_ONLY": assignments.get("CHECK_ONLY", "1")})
        errors = [line for line in launched.stderr.splitlines() if line.startswith("error:")]
        own = [v for v in {**env, **assignments}.values() if v.startswith("/") and not os.path.exists(v)]
        wrong = [e for e in errors if not any(path in e for path in own)]  # only the user's own files missing
        return "\n".join(wrong) if launched.returncode not in (0, 2) or wrong else ""
    if program == "torchrun" or words[:2] == ["python", "-m"]:
        module_at = words.index("-m") + 1
        module, args = words[module_at], words[module_at + 1:]
        usage = _usage(__import__("importlib").import_module(module).main)
        unknown = _flags_taken(args, usage)
        if unknown or any("[" in w for w in args) or module != "megatron_rlhf.train":
            return f"{module} does not take {unknown}" if unknown else ""
        config = args[args.index("--config") + 1]
        if not (REPO / config).is_file():
            return f"{config}: no such file"
        nproc = next((w.split("=")[1] for w in words[:module_at] if w.startswith("--nproc_per_node=")), "1")
        checked = run([sys.executable, "-m", module, *args, "--check-only", "--world-size", nproc, "--output-dir",
                       str(tmp_path / "out")], **env, **assignments)
        return "" if checked.returncode == 0 else checked.stderr
    if program == "python" and words[1].startswith(("tools/", "examples/")):
        usage = _usage(__import__("runpy").run_path(str(REPO / words[1]), run_name="documented")["main"])
        unknown = _flags_taken(words[2:], usage)
        return f"{words[1]} does not take {unknown}" if unknown or not usage else ""
    return f"a command this test does not know how to check: {' '.join(words)}"


def test_every_command_the_docs_show_runs_as_written(tmp_path):
    commands = list(documented_commands())
    assert len(commands) >= 15
    wrong = [f"{page}: {' '.join(words)}: {what}" for page, env, words in commands
             if (what := _check_command(env, words, tmp_path))]
    assert wrong == [], "\n".join(wrong)


def test_a_command_mistyped_in_the_docs_fails_the_check(tmp_path):
    """Mutations of documented commands: a flag a tool does not take, a key the schema does not have,
    a make target that does not exist, a config that is not in the checkout."""
    for words in (["python", "tools/convert_hf_to_megatron.py", "--hf-dir", "x", "--output", "y", "--tpp", "2"],
                  ["torchrun", "--nproc_per_node=2", "-m", "megatron_rlhf.train", "--config", "examples/tiny/grpo.yaml",
                   "ppo.kl_cof=0.005"],
                  ["make", "demo-nothing"],
                  ["torchrun", "--nproc_per_node=2", "-m", "megatron_rlhf.train", "--config", "examples/tiny/nope.yaml"],
                  ["DRY_RUN=1", "MODEL_SIZE=70bb", "bash", "examples/llama2/run_ppo.sh"]):
        assert _check_command({}, words, tmp_path), words

"""Projects made with cruft take the template's later changes: real git repositories, the real cruft command line.

The template is copied into a temporary git repository (commit A) and baked from there with `cruft create`, as a
team would from gh:org/template. The baked project is committed and edited in its own room; the template then moves
on (commit B) and `cruft update` brings that change over without losing the edits. A later change to a line the
team also edited shows what a conflict looks like.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ANSWERS = {"project": "vision-lab", "package": "vlab", "license": "none", "author": "Ada"}
BALANCED = Path("{{cookiecutter.project}}/conf/loader/balanced.yaml")
LATER_FILE = Path("{{cookiecutter.project}}/conf/loader/later.yaml")
EPOCHS = re.compile(r"^epochs: *(\S+)", re.MULTILINE)


@pytest.fixture
def env(cookiecutter_config, tmp_path):
    """A git identity and no user or system git config (a CI machine has neither); cookiecutter's own config
    is the test one, so ~/.cookiecutterrc cannot change the answers."""
    gitconfig = tmp_path / "gitconfig"
    gitconfig.write_text("")
    return {
        **os.environ,
        "GIT_AUTHOR_NAME": "Test",
        "GIT_AUTHOR_EMAIL": "test@example.com",
        "GIT_COMMITTER_NAME": "Test",
        "GIT_COMMITTER_EMAIL": "test@example.com",
        "GIT_CONFIG_GLOBAL": str(gitconfig),
        "GIT_CONFIG_NOSYSTEM": "1",
        "COOKIECUTTER_CONFIG": str(cookiecutter_config),
        "NO_COLOR": "1",
        "COLUMNS": "200",
    }


def run(args, cwd, env, ok=True):
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)
    if ok:
        assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def cruft(args, cwd, env, ok=True):
    return run([sys.executable, "-m", "cruft", *args], cwd, env, ok)


def commit_all(repo, message, env) -> str:
    run(["git", "add", "-A"], repo, env)
    run(["git", "commit", "-q", "-m", message], repo, env)
    return run(["git", "rev-parse", "HEAD"], repo, env).stdout.strip()


def template_repo(template_dir, dest, env) -> tuple[Path, str]:
    """The template as this checkout holds it (tracked and new files, not ignored ones), committed in a new
    repository: (its path, commit A)."""
    # The user's own git settings here (safe.directory, say): this reads their checkout.
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], template_dir, None, ok=False)
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.split("\0")):
            source = template_dir / name
            if source.is_file():  # a tracked file deleted in the checkout is left out, as a bake would
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dest / name)
    else:  # not a git checkout (an unpacked archive): everything but what .gitignore names
        ignored = shutil.ignore_patterns(".git", ".venv", "scratch", "build", "__pycache__", "*.pyc", ".*_cache")
        shutil.copytree(template_dir, dest, ignore=ignored, dirs_exist_ok=True)
    assert (dest / "local_extensions.py").is_file() and (dest / "cookiecutter.json").is_file()
    run(["git", "init", "-q"], dest, env)
    return dest, commit_all(dest, "template: commit A", env)


def baked_project(template, commit, out, env) -> Path:
    """`cruft create` of the template at `commit`, committed in the project's own repository."""
    cruft(
        [
            "create",
            str(template),
            "--no-input",
            "--output-dir",
            str(out),
            "--checkout",
            commit,
            "--extra-context",
            json.dumps(ANSWERS),
        ],
        out,
        env,
    )
    project = out / ANSWERS["project"]
    run(["git", "init", "-q"], project, env)
    commit_all(project, "baked with cruft", env)
    return project


def recorded_commit(project) -> str:
    return json.loads((project / ".cruft.json").read_text())["commit"]


def test_cruft_update_brings_template_changes_and_keeps_the_teams_edits(template_dir, env, tmp_path):
    (tmp_path / "template").mkdir()
    (tmp_path / "out").mkdir()
    template, commit_a = template_repo(template_dir, tmp_path / "template", env)
    project = baked_project(template, commit_a, tmp_path / "out", env)
    package = project / ANSWERS["package"]
    # The bake went through local_extensions.AnswerChecks (cruft puts its clone of the template on sys.path)
    # and the post-generation hook (license=none: no LICENSE).
    state = json.loads((project / ".cruft.json").read_text())
    assert state["commit"] == commit_a and state["template"] == str(template)
    assert state["context"]["cookiecutter"]["__answers"] == "ok"
    assert (package / "tasks.py").is_file() and not (project / "LICENSE").exists()

    # The team's edits: a line of their own in tasks.py, a new module, another epochs value.
    config = project / "conf/config.yaml"
    found = EPOCHS.search(config.read_text())
    assert found, "conf/config.yaml has no `epochs:` line to edit"
    theirs = "3" if found.group(1) != "3" else "4"
    config.write_text(EPOCHS.sub(f"epochs: {theirs}", config.read_text(), count=1))
    team_line = "TEAM_DEFAULT_TASK = Classification  # the team's own line\n"
    with open(package / "tasks.py", "a") as f:
        f.write("\n" + team_line)
    (package / "our_task.py").write_text('"""The team\'s own module."""\n')
    commit_all(project, "our edits", env)
    assert cruft(["check"], project, env).returncode == 0, "up to date with commit A"

    # The template moves on elsewhere: a line in a profile and a new rendered file (commit B).
    template_line = "# a later template change (test_cruft)"
    with open(template / BALANCED, "a") as f:
        f.write(template_line + "\n")
    (template / LATER_FILE).write_text("# made for {{ cookiecutter.package }}\non_budget: error\n")
    commit_b = commit_all(template, "template: commit B", env)

    # Negative control: before the update the change is absent and `cruft check` says the project is behind.
    balanced = project / "conf/loader/balanced.yaml"
    assert template_line not in balanced.read_text() and not (project / "conf/loader/later.yaml").exists()
    behind = cruft(["check"], project, env, ok=False)
    assert behind.returncode != 0 and "out of date" in behind.stdout + behind.stderr

    cruft(["update", "--skip-apply-ask", "--allow-untracked-files"], project, env)

    assert balanced.read_text().splitlines()[-1] == template_line
    assert (project / "conf/loader/later.yaml").read_text().startswith("# made for vlab\n"), "rendered with the answers"
    assert EPOCHS.search(config.read_text()).group(1) == theirs
    assert (package / "tasks.py").read_text().endswith(team_line)
    assert (package / "our_task.py").is_file() and not (project / "LICENSE").exists()
    assert recorded_commit(project) == commit_b
    assert cruft(["check"], project, env).returncode == 0, "up to date with commit B"
    status = run(["git", "status", "--porcelain"], project, env).stdout.splitlines()
    assert sorted(line[3:] for line in status) == [".cruft.json", "conf/loader/balanced.yaml", "conf/loader/later.yaml"]


def test_a_conflicting_template_change_is_left_as_conflict_markers(template_dir, env, tmp_path):
    """Template and team change the same line: the update exits 0 and says all is well, the file holds git's
    conflict markers and is unmerged in `git status`, and .cruft.json already records the new commit."""
    (tmp_path / "template").mkdir()
    (tmp_path / "out").mkdir()
    template, commit_a = template_repo(template_dir, tmp_path / "template", env)
    project = baked_project(template, commit_a, tmp_path / "out", env)
    config = project / "conf/config.yaml"
    config.write_text(EPOCHS.sub("epochs: 3", config.read_text(), count=1))
    commit_all(project, "our epochs", env)
    template_config = template / "{{cookiecutter.project}}/conf/config.yaml"
    template_config.write_text(EPOCHS.sub("epochs: 11", template_config.read_text(), count=1))
    commit_b = commit_all(template, "template: other epochs", env)

    update = cruft(["update", "--skip-apply-ask", "--allow-untracked-files"], project, env)

    text = config.read_text()
    assert re.search(r"^<<<<<<< .*\nepochs: 3\b.*\n=======\nepochs: 11\b.*\n>>>>>>> ", text, re.MULTILINE), text
    assert "with conflicts" in update.stdout + update.stderr
    status = run(["git", "status", "--porcelain"], project, env).stdout.splitlines()
    assert "UU conf/config.yaml" in status
    assert recorded_commit(project) == commit_b


def test_cruft_create_refuses_a_bad_answer_and_writes_nothing(template_dir, env, tmp_path):
    """local_extensions.py's checks run under cruft too: exit code 1, the ERROR line (after cruft's traceback)."""
    (tmp_path / "template").mkdir()
    (tmp_path / "out").mkdir()
    template, _ = template_repo(template_dir, tmp_path / "template", env)
    proc = cruft(
        [
            "create",
            str(template),
            "--no-input",
            "--output-dir",
            str(tmp_path / "out"),
            "--extra-context",
            json.dumps({"project": "123lab"}),
        ],
        tmp_path,
        env,
        ok=False,
    )
    output = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1
    assert (
        "ERROR: package '123lab', the import name derived from project '123lab', is not a Python identifier" in output
    )
    assert not any((tmp_path / "out").iterdir())

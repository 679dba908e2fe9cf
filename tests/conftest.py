"""Template-level fixtures: bake the template with the cookiecutter API into tmp dirs."""
from pathlib import Path

import pytest
from cookiecutter.main import cookiecutter

TEMPLATE_DIR = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def template_dir():
    """The repository root, which is the template (it holds cookiecutter.json)."""
    return TEMPLATE_DIR


@pytest.fixture(scope="session")
def cookiecutter_config(tmp_path_factory):
    """A config file keeping cookiecutter's replay/clone dirs out of $HOME and
    ignoring any ~/.cookiecutterrc, so a user's default_context cannot change answers."""
    home = tmp_path_factory.mktemp("cookiecutter-home")
    config = home / "config.yaml"
    config.write_text(
        f'cookiecutters_dir: "{home / "cookiecutters"}"\n'
        f'replay_dir: "{home / "replay"}"\n'
    )
    return config


@pytest.fixture
def bake(template_dir, cookiecutter_config):
    """bake(output_dir, **extra_context) -> Path of the generated project."""

    def _bake(output_dir, **extra_context):
        project = cookiecutter(
            str(template_dir),
            no_input=True,
            extra_context=extra_context,
            output_dir=str(output_dir),
            config_file=str(cookiecutter_config),
        )
        return Path(project)

    return _bake

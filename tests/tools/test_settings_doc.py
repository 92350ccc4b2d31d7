"""docs/settings.md is what the code generates: every TrainConfig field and launcher variable, with its default."""

import dataclasses

from conftest import REPO

from experiment.config import TrainConfig
from experiment.tools.settings_doc import LAUNCHER, render


def test_the_settings_page_is_generated_from_the_code():
    page = (REPO / "docs" / "settings.md").read_text()
    assert page == render(), "docs/settings.md is stale: python -m experiment.tools.settings_doc > docs/settings.md"
    assert all(f"`--{f.name}`" in page for f in dataclasses.fields(TrainConfig))


def test_every_launcher_variable_on_the_page_is_read_by_the_launcher():
    launcher = (REPO / "experiment" / "run.sh").read_text()
    assert all(name in launcher for name, _, _ in LAUNCHER)

"""`python -m study_cli`: the `leap` command with the study commands, also from a checkout where the studies
are not installed (PYTHONPATH=.:studies), as the prepared GPU run uses it."""

from leap_cli.main import app
from study_cli.apps import register

register(app)
app()

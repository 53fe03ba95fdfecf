"""Root conftest: only the list of fixture modules (pytest reads ``pytest_plugins`` here alone)."""

pytest_plugins = [
    "fixtures.options",
    "fixtures.workers",
    "fixtures.dist",
    "fixtures.models",
    "fixtures.cases",
    "fixtures.report",
    "fixtures.properties",
]

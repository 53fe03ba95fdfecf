"""Root conftest of a checkout: loads the pytest plugin when offload-harness is not installed
(installed, its ``pytest11`` entry point has already registered it under this same name, and
pytest then skips this line)."""

pytest_plugins = ["harness.plugin"]

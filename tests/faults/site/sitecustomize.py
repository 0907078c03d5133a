"""Run at start-up by every Python process the fault harness launches (this folder comes first on PYTHONPATH):
installs the fault ``DSX_FAULT`` describes. Its patches apply when dsx's modules are imported, so the
launcher's own processes, which never import them, run untouched."""

import os

if os.environ.get("DSX_FAULT"):
    from dsx.testing.faults import install_from_env

    install_from_env()

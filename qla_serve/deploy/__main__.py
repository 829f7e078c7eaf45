"""``python -m qla_serve.deploy ...``: the deployment commands without the rest of the CLI."""

import sys

from .cli import main

sys.exit(main())

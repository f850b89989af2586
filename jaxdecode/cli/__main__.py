"""``python -m jaxdecode.cli``: the command line."""

import sys

from jaxdecode.cli.main import main

sys.exit(main())

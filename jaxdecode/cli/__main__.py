"""``python -m jaxdecode.cli``: the command line."""

import sys

from jaxdecode.cli.app import main

sys.exit(main())

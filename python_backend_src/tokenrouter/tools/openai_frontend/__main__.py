"""``python -m tokenrouter.tools.openai_frontend``: see :func:`tokenrouter.tools.openai_frontend.server.main`."""

import sys

from .server import main

sys.exit(main())

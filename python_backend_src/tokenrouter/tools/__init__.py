"""Operator tools: admin calls, the CLI client, repositories and deployments, the OpenAI front end, soak,
router training, and the no-Triton benchmark path (:mod:`tokenrouter.tools.direct`).

Each runs as ``python -m tokenrouter.tools.<name>``.
"""

import os

#: what the tools' ``--url`` help says about their default
GRPC_URL_HELP = "Triton gRPC address (default localhost:$TOKENROUTER_GRPC_PORT, else localhost:8001)"


def default_grpc_url() -> str:
    """``localhost:$TOKENROUTER_GRPC_PORT``, or ``localhost:8001`` where it is unset or empty (str)."""
    return f"localhost:{os.environ.get('TOKENROUTER_GRPC_PORT') or 8001}"

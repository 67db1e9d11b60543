"""Operator tools: admin calls, the CLI client, repositories and deployments, the OpenAI front end, soak, router training."""

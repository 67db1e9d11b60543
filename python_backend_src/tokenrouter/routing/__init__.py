"""Request-centric routing: the router's inter-model loop, PeerReq messages, the ZeroMQ channel, online B*."""

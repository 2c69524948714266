"""actor: inference over HTTP (torch on CPU, vLLM on GPU), loads each announced policy version."""

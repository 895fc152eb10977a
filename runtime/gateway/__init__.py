"""`capstan gateway`: an OpenAI-compatible router in front of the replicas of every InferenceService (docs/gateway.md).
No JAX here: the gateway starts in a second and runs in a small pod."""

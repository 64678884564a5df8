"""Conversations with tools, engine-free: the tools a run offers (tools.py, run in the reward
sandbox by tool_worker.py), the Hermes call format OpenAI tools are written in (hermes.py), and
how one turn becomes token ids (turn_formats.py).

It sits below `rollout` (whose agent loop drives it) and `models` (whose SmolLM2 tool warm-up
renders demonstrations through it, token for token as the rollout does), and imports neither.
"""

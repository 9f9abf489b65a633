"""Accuracy on the engine's own path: `tasks` (perplexity, agreement, passkey, attention loss),
`metrics`, `sweep` (policies x budgets x tasks, resumable) and `sweep_report`."""

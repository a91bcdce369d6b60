"""Report text and scoring: templates and prompts, the parser, scores and the evaluation tables."""

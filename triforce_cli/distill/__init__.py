"""`triforce distill`: training a small drafter for a target with the top-K distillation loss (HASS)."""

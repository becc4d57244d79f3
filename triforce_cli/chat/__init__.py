"""Conversations about one long document: the questions and answers of a session, as the target's chat template
renders them (session.py)."""

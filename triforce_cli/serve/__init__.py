"""`triforce serve`: an OpenAI-compatible HTTP server over one loaded Pipeline (docs/serving.md).

app.py builds the FastAPI application (create_app), schemas.py holds the request and response models and the field
policy, worker.py runs the generations one at a time on a thread of its own, metrics.py counts them for /metrics.
"""

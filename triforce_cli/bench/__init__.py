"""`triforce bench`: our modes and the peers (transformers, llama.cpp) timed side by side on the same prompts."""

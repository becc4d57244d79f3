"""The model runtime: the decoder, checkpoint loading, weight formats, context extension, the embedded default."""

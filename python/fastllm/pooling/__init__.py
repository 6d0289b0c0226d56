"""Pooling models: embeddings, scores and classes (vLLM's ``runner="pooling"``).

- ``params.py``: ``PoolingParams`` (``dimensions``, ``normalize``, ``activation``).
- ``runner.py``: the ``PoolingRunner`` protocol that every pooling model
  implements (tokenize, pool, classify) and ``PoolerConfig`` (how the model
  pools, read from the sentence-transformers files of the folder).
- ``encoder.py``: encoder models (BERT, RoBERTa / XLM-RoBERTa, ModernBERT)
  run without a KV cache, padding-free: ``EncoderRunner``, ``load_encoder``.
  The models are ``bert.py`` and ``modernbert.py``; what they share (the
  packed batch, bidirectional attention) ``encoder_layers.py``; the
  sentence-transformers files (pooling mode, Dense, Normalize) ``st_config.py``.
- ``decoder.py``: decoder models as embedders (Qwen3-Embedding: last-token
  pooling) through the paged engine's prefill.
- ``engine.py``: ``PoolingEngine``, what ``LLM.embed`` / ``score`` /
  ``classify`` and the server's pooling routes call.
"""

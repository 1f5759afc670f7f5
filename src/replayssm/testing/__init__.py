"""Test support that ships with the package, outside the stable API.

* :mod:`.lifecycle`: :class:`~.lifecycle.Lifecycle`, a state pool driven through
  random verify -> accept -> commit steps and checked after each against a float64
  oracle and an independent transcription of the recurrence (the strategy tests and
  ``replayssm demo`` use it);
* :mod:`.checkpoints`: checkpoint directories of random-weight models with a
  byte-level tokenizer (:func:`~.checkpoints.save_tiny_checkpoint`), for tests and
  examples that need a model on disk;
* :mod:`.hashes`: the counter hash on Python ints, the independent implementation
  that the hash op and the forced drafter are tested against.

Nothing in the library imports this package; it may change without notice.
"""

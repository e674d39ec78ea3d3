"""Speech: TTS corpora, features, text normalization and WER, the CTC encoder model, Whisper helpers.

The public functions: `build_corpus` (`moekit speech corpus`) with its `CorpusConfig`, and `read_manifest`.
"""
from moekit.speech.corpus import CorpusConfig, Utterance, build_corpus, read_manifest

__all__ = ["CorpusConfig", "Utterance", "build_corpus", "read_manifest"]

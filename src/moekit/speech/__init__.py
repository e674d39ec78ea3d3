"""Speech: TTS corpora, features, text normalization and WER, the CTC encoder model, Whisper helpers."""

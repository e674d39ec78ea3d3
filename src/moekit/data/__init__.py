from moekit.data.parallel import LANG_NAMES, Pair, TranslationCollator, encode_pair, load_pairs

__all__ = ["LANG_NAMES", "Pair", "TranslationCollator", "encode_pair", "load_pairs"]

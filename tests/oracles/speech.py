"""Real speech for audio tests, spoken by eSpeak NG from the PyPI wheel espeakng-loader.

The wheel ships libespeak-ng and its voice data, so tests need no system package: we
call the C API through ctypes (espeak_Synth in synchronous mode, samples collected by
the synth callback) and resample its 22050 Hz output to 16 kHz with scipy's polyphase
filter.
"""
from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

_lock = threading.Lock()
_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


@functools.lru_cache(maxsize=1)
def _lib():
    import espeakng_loader

    lib = ctypes.CDLL(espeakng_loader.get_library_path())
    lib.espeak_Initialize.restype = ctypes.c_int
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.espeak_SetSynthCallback.argtypes = [_CB]
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    lib.espeak_Synth.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                 ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
    # AUDIO_OUTPUT_SYNCHRONOUS = 2; buffer length 0 (default); options 0
    rate = lib.espeak_Initialize(2, 0, espeakng_loader.get_data_path().encode(), 0)
    if rate <= 0:
        raise RuntimeError("espeak-ng failed to initialize")
    return lib, rate


@functools.lru_cache(maxsize=32)
def speak(text: str, voice: str = "en-us") -> np.ndarray:
    """``text`` spoken at 16 kHz mono, float32 in [-1, 1]."""
    from scipy.signal import resample_poly

    with _lock:
        lib, rate = _lib()
        chunks = []

        def cb(wav, n, _events):
            if n > 0:
                chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
            return 0

        cfun = _CB(cb)
        lib.espeak_SetSynthCallback(cfun)
        if lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise RuntimeError(f"espeak-ng has no voice {voice!r}")
        data = text.encode() + b"\0"
        # position 0, POS_CHARACTER = 1, end 0, espeakCHARS_UTF8 = 1, no unique id / user data
        err = lib.espeak_Synth(data, len(data), 0, 1, 0, 1, None, None)
        if err != 0:
            raise RuntimeError(f"espeak_Synth failed ({err})")
    pcm = np.concatenate(chunks).astype(np.float32) / 32768.0
    g = np.gcd(16000, rate)
    return resample_poly(pcm, 16000 // g, rate // g).astype(np.float32)

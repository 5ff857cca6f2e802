"""The flight recorder: triggers on a process's own series and their judgment (triggers,
series), the recorder that fires them into captures (recorder, baseline), the captures
themselves (captures: also POST /capture's) and the kept ones on disk (capturestore)."""

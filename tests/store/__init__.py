"""The model store and the Hub: pull, ls, rm and info against a Hub look-alike, and a hostile one."""

"""Source that makes this distribution's packages unimportable in a child interpreter (remote-code and model-card
tests: what runs there must work from a Hub folder alone, whatever the interpreter's site-packages hold)."""

BLOCK_LOCAL_PACKAGES = '''
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top == "modeling_jrt" or top.startswith("jrt_"):
            raise ModuleNotFoundError(name)

sys.meta_path.insert(0, Block())
'''

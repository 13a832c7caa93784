"""The ``zoo`` marker: third-party models under their own tensor-parallel plans (slow)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "zoo: third-party models (torchtitan, Hugging Face) trained on 2 gloo ranks with kareus "
        "against eager (deselect with -m 'not zoo')",
    )

"""The offline tiny-model builders that demos and tests train without a download."""

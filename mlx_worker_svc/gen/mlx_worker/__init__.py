# Generated from protos/ by `make proto`. DO NOT EDIT.

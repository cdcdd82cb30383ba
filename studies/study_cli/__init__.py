"""The study commands (`leap eval`, `leap bench`, `leap corpus`, `leap demo`, `leap replay`, `leap simulate`),
reached from the product's `leap` through the `leap.commands` entry point."""

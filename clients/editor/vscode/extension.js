// Starts `llmd lsp` as a language server; VS Code shows its inline completions as ghost text.
// Inline completion is a proposed feature in vscode-languageclient 9, hence registerProposedFeatures.
const vscode = require("vscode");
const { LanguageClient } = require("vscode-languageclient/node");

let client;

function serverOptions() {
  const cfg = vscode.workspace.getConfiguration("llmd");
  const args = ["lsp", ...cfg.get("args", [])];
  const socket = cfg.get("socket", "");
  if (socket) args.push("--socket", socket);
  return { command: cfg.get("command", "llmd"), args };
}

async function activate(context) {
  const languages = vscode.workspace.getConfiguration("llmd").get("languages", []);
  client = new LanguageClient("llmd", "llmd", serverOptions(), {
    documentSelector: languages.map((language) => ({ scheme: "file", language })),
  });
  client.registerProposedFeatures();
  await client.start();
  context.subscriptions.push({ dispose: () => client && client.stop() });
}

function deactivate() {
  return client ? client.stop() : undefined;
}

module.exports = { activate, deactivate };

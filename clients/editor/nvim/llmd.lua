-- llmd code completion for Neovim, with the built-in LSP client (no plugins).
--
--   require("llmd").setup({ socket = nil, filetypes = { "python", "lua" }, accept = "<Tab>" })
--
-- Neovim 0.12+: ghost text from textDocument/inlineCompletion; `accept` takes it.
-- Neovim 0.11:  suggestions arrive as completion items (vim.lsp.completion, autotrigger).
local M = {}

local defaults = {
  cmd = { "llmd", "lsp" },
  socket = nil,          -- daemon socket; default: $LLMD_SOCKET or the usual location
  args = {},             -- more `llmd lsp` flags, e.g. { "--max-tokens", "32" }
  filetypes = { "python", "lua", "c", "cpp", "rust", "go", "javascript", "typescript", "sh", "java" },
  accept = "<Tab>",      -- key that accepts the ghost text (0.12+); falls through when there is none
}

local function command(opts)
  local cmd = vim.list_extend({}, opts.cmd)
  if opts.socket then
    vim.list_extend(cmd, { "--socket", opts.socket })
  end
  return vim.list_extend(cmd, opts.args)
end

local function on_attach(opts, client, bufnr)
  if vim.lsp.inline_completion then
    vim.lsp.inline_completion.enable(true, { bufnr = bufnr })
    vim.keymap.set("i", opts.accept, function()
      if not vim.lsp.inline_completion.get() then
        return opts.accept
      end
    end, { expr = true, replace_keycodes = true, buffer = bufnr, desc = "llmd: accept suggestion" })
  elseif vim.lsp.completion then
    vim.lsp.completion.enable(true, client.id, bufnr, { autotrigger = true })
  end
end

function M.setup(user)
  local opts = vim.tbl_deep_extend("force", defaults, user or {})
  local group = vim.api.nvim_create_augroup("llmd", { clear = true })
  vim.api.nvim_create_autocmd("FileType", {
    group = group,
    pattern = opts.filetypes,
    callback = function(ev)
      vim.lsp.start({
        name = "llmd",
        cmd = command(opts),
        root_dir = vim.fs.root(ev.buf, { ".git" }) or vim.fn.getcwd(),
        on_attach = function(client, bufnr) on_attach(opts, client, bufnr) end,
      }, { bufnr = ev.buf })
    end,
  })
end

return M
